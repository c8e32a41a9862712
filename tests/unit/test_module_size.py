"""No source module grows past what a reader holds in their head: over MAX_LINES lines, split it
by job (docs/architecture.md lists the jobs of each package)."""

from __future__ import annotations

from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "decentrl"
MAX_LINES = 600


def oversized_modules(source: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Every module under `source` longer than `max_lines`, as "path: N lines", longest first."""
    sizes = [(len(path.read_text().splitlines()), path.relative_to(source).as_posix())
             for path in source.rglob("*.py")]
    return [f"{name}: {lines} lines" for lines, name in sorted(sizes, reverse=True)
            if lines > max_lines]


def test_no_source_module_is_over_600_lines() -> None:
    assert oversized_modules(SOURCE) == []


def test_the_check_names_an_oversized_module(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "node.py").write_text("x = 1\n" * 601)
    (tmp_path / "net" / "small.py").write_text("x = 1\n" * 600)
    (tmp_path / "big.py").write_text("x = 1\n" * 700)
    assert oversized_modules(tmp_path) == ["big.py: 700 lines", "net/node.py: 601 lines"]
