"""docs/config.md, generated from the config itself: every field of every section with its type,
default, range and description. `python -m decentrl.config.docs > docs/config.md` writes it; a
test fails when a field has no description or the page is stale."""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from decentrl.config.run import RunConfig

REGENERATE = "python -m decentrl.config.docs > docs/config.md"
INTRODUCTION = f"""\
# Configuration

<!-- Generated from src/decentrl/config/ by `{REGENERATE}`; do not edit. -->

A run is described by one TOML file (`examples/demo.toml` is the demo's), given to
`decentrl train --config FILE`, `decentrl coordinate --config FILE` or read by `decentrl demo`.
Every field below has a default; a file names only what it changes. Unknown fields are errors
that name the field, and so are the former names of renamed ones.

- **A file may extend another**: `extends = "demo.toml"` (relative to the file) takes that file's
  config, then this file's sections change it field by field; a field's value, an inline table
  such as `task.options` too, replaces the other file's whole.
- **One field from the command line**: `--set SECTION.FIELD=VALUE`, repeatable, on `train`,
  `coordinate` and `demo` (and `host.*` on `join`). The value is a TOML value (`--set
  train.lr=1e-5`, `--set task.options={{min_digits=3}}`, `--set host.link.rtt_ms=[60,120]`); a
  bare word is a string (`--set host.device=cuda`).
- **The run and the host**: every section but `[host]` is the run's identity: its hash, the
  manifest peers join by, and what a resumed run must bring again (only `train.steps` and
  `train.time_budget_s` may change). `[host]` is each machine's own: a GPU peer in bf16 and a CPU
  peer in fp32 join the same run, each with its own `--set host.FIELD=VALUE` or file.
"""


def type_text(annotation: Any) -> str:
    """An annotation as a reader of a TOML file thinks of it."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(argument) for argument in arguments)
    if origin in (typing.Union, types.UnionType):
        kept = [type_text(argument) for argument in arguments if argument is not type(None)]
        return " \\| ".join(kept) + (" \\| none" if len(kept) < len(arguments) else "")
    if origin is tuple:
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return f"list of {type_text(arguments[0])}"
        return "[" + ", ".join(type_text(argument) for argument in arguments) + "]"
    if origin is dict or annotation is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def default_text(default: Any) -> str:
    if default is PydanticUndefined:
        return "required"
    if default is None:
        return "none"
    if isinstance(default, BaseModel):
        return "see below"
    if isinstance(default, Path):
        return f"`{json.dumps(str(default))}`"
    return f"`{json.dumps(default)}`"


BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
          (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))


def range_text(field: FieldInfo) -> str:
    parts = []
    for constraint in field.metadata:
        for kind, attribute, sign in BOUNDS:
            if isinstance(constraint, kind):
                bound = getattr(constraint, attribute)
                parts.append(f"{sign} {bound:g}" if isinstance(bound, float) else
                             f"{sign} {bound}")
        pattern = getattr(constraint, "pattern", None)
        if pattern is not None:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


Table = tuple[str, type[BaseModel], BaseModel | None]


def tables(model: type[BaseModel], prefix: str, defaults: BaseModel | None = None
           ) -> Iterator[Table]:
    """(dotted name, section, its default value if its parent sets one) of `model`'s own table
    and every table inside it, in order: eval.task's defaults are eval's, not [task]'s."""
    yield prefix, model, defaults
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            inner = getattr(defaults, name) if defaults is not None else field.get_default()
            yield from tables(annotation, f"{prefix}.{name}" if prefix else name, inner)


def section_text(name: str, model: type[BaseModel], defaults: BaseModel | None,
                 described: str | None) -> str:
    title = f"## [{name}]" if name else "## Top level"
    lines = [title, ""]
    about = described or inspect.getdoc(model)
    if about:
        lines += [" ".join(about.split()), ""]
    lines += ["| field | type | default | range | description |", "|---|---|---|---|---|"]
    for field_name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and not name:
            continue  # a top-level section: its own heading below
        default = (getattr(defaults, field_name) if defaults is not None
                   else field.get_default(call_default_factory=True))
        lines.append(f"| `{field_name}` | {type_text(annotation)} | "
                     f"{default_text(default)} | "
                     f"{range_text(field)} | {cell(field.description or '')} |")
    return "\n".join(lines)


def field_description(path: str) -> str | None:
    """The description of the field at dotted `path` of RunConfig, if it has one."""
    model: type[BaseModel] = RunConfig
    field = None
    for part in path.split("."):
        field = model.model_fields[part]
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
    return field.description if field is not None else None


def config_markdown() -> str:
    sections = [section_text(name, model, defaults,
                             field_description(name) if "." in name else None)
                for name, model, defaults in tables(RunConfig, "")]
    return INTRODUCTION + "\n" + "\n\n".join(sections) + "\n"


def undescribed_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every field of the config (at any depth) without a description, and every section class
    without a docstring, by dotted name."""
    missing = [] if inspect.getdoc(model) and model.__doc__ else [prefix or "the run config"]
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if prefix and not field.description:
                missing.append(path)
            missing += undescribed_fields(annotation, path)
        elif not field.description:
            missing.append(path)
    return missing


if __name__ == "__main__":
    print(config_markdown(), end="")
