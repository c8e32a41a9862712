"""`--set SECTION.FIELD=VALUE`: one field of the config changed from the command line. The value
is read as a TOML value (1e-5, true, [60, 120], {min_digits = 3}, "text"); a bare word is a
string. The field must exist, or the error names it; its value is checked with the rest of the
config."""

from __future__ import annotations

import copy
import tomllib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from decentrl.config.base import ConfigError
from decentrl.config.renames import renamed_message


def parse_value(text: str) -> Any:
    """`text` as a TOML value, or as a string when it is none (a bare word such as cuda)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
        else None


def _is_table(annotation: Any) -> bool:
    """A free-form table (such as task.options), whose keys the config does not list."""
    return annotation is dict or typing.get_origin(annotation) is dict


def check_path(model: type[BaseModel], path: str) -> None:
    """Raise ConfigError unless `path` ("train.lr", "task.options.min_digits") names a field of
    `model`, or a key inside one of its free-form tables."""
    moved = renamed_message(path)
    if moved is not None:
        raise ConfigError(moved)
    parts = path.split(".")
    current: type[BaseModel] | None = model
    for depth, part in enumerate(parts):
        if current is None:
            raise ConfigError(f"unknown field {path}: {'.'.join(parts[:depth])} is a value, "
                              "not a section")
        field = current.model_fields.get(part)
        if field is None:
            where = ".".join(parts[:depth])
            known = ", ".join(current.model_fields)
            raise ConfigError(f"unknown field {path}; the fields of "
                              f"{where or 'the config'} are {known}")
        if _is_table(field.annotation):
            return  # keys inside a free-form table are the task's to check
        current = _section_type(field.annotation)


def apply_settings(data: Mapping[str, Any], settings: Sequence[str],
                   model: type[BaseModel]) -> dict[str, Any]:
    """`data` (a config as read) with each `SECTION.FIELD=VALUE` of `settings` set, the later
    winning; each path is checked against `model`'s fields."""
    changed = copy.deepcopy(dict(data))
    for setting in settings:
        path, sep, text = setting.partition("=")
        path = path.strip()
        if not sep or not path:
            raise ConfigError(f"--set {setting!r} must look like SECTION.FIELD=VALUE, such as "
                              "train.lr=1e-5")
        try:
            check_path(model, path)
        except ConfigError as error:
            raise ConfigError(f"--set {path}: {error}") from None
        *sections, leaf = path.split(".")
        table = changed
        for section in sections:
            inner = table.get(section)
            table[section] = inner = dict(inner) if isinstance(inner, Mapping) else {}
            table = inner
        table[leaf] = parse_value(text.strip())
    return changed
