"""The packages of src/decentrl form layers (docs/architecture.md): a module imports only from its
own layer or below. Every import counts, those inside functions too: a lazy import from above is
still a cycle waiting to happen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "src" / "decentrl"

# Lowest first. A name is a package (a folder) or a module at the top of src/decentrl.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("config", "device", "plugins", "progress", "staging"),
    ("tasks", "envs"),
    ("model",),
    ("rollout",),
    ("learn",),
    ("evaluate",),
    ("net",),
    ("sync",),
    ("trust",),
    ("observe",),
    ("release",),
    ("stage",),
    ("client",),
    ("coordinator",),
    ("launch",),
    ("demo", "cli"),
    ("sim",),
)
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}


def top_name(module: str) -> str | None:
    """`decentrl.net.node` -> "net"; None for imports from outside the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "decentrl" and len(parts) > 1 else None


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def upward_imports(source: Path) -> list[str]:
    """Every import of a module from a layer above its own, as "file:line imports module"."""
    problems = []
    for path in sorted(source.rglob("*.py")):
        relative = path.relative_to(source)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        own = relative.parts[0].removesuffix(".py")
        if own not in LAYER_OF:
            problems.append(f"{relative} is in no layer: add its package to LAYERS")
            continue
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            target = top_name(module)
            if target is None:
                continue
            if target not in LAYER_OF:
                problems.append(f"{relative}:{line} imports {module}, which is in no layer")
            elif LAYER_OF[target] > LAYER_OF[own]:
                problems.append(f"{relative}:{line} ({own}) imports {module} from the layer "
                                f"above it ({target})")
    return problems


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(SOURCE) == []


def test_the_check_names_an_upward_import(tmp_path: Path) -> None:
    package = tmp_path / "decentrl"
    (package / "model").mkdir(parents=True)
    (package / "stage").mkdir()
    (package / "model" / "blocks.py").write_text(
        "import torch\n\n\ndef f():\n    from decentrl.stage.peer import StagePeer\n")
    (package / "stage" / "peer.py").write_text("from decentrl.model.blocks import f\n")
    (package / "stray.py").write_text("")
    assert upward_imports(package) == [
        "model/blocks.py:5 (model) imports decentrl.stage.peer from the layer above it (stage)",
        "stray.py is in no layer: add its package to LAYERS",
    ]


@pytest.mark.parametrize("name", sorted(LAYER_OF))
def test_every_layer_names_a_real_package_or_module(name: str) -> None:
    assert (SOURCE / name).is_dir() or (SOURCE / f"{name}.py").is_file()


def test_no_module_imports_the_bench_package() -> None:
    """bench/ lives in the source checkout and in no wheel, so an import of it from src/decentrl
    would break an installed decentrl (`decentrl bench` finds a bench by name, through importlib)."""
    found = [f"{path.relative_to(SOURCE)}:{line} imports {module}"
             for path in sorted(SOURCE.rglob("*.py"))
             for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
             if module.split(".")[0] == "bench"]
    assert found == []
