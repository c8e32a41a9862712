"""Reading a run config: a TOML file (which may extend another), a run folder's config.json, or
a dict, with --set changes on top. Unknown fields and former names are errors, and every error
names the field it is about."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from decentrl.config.base import ConfigError
from decentrl.config.host import HostConfig
from decentrl.config.overrides import apply_settings
from decentrl.config.renames import former_names
from decentrl.config.run import HOST_SECTION, RunConfig

# A TOML config may name the file it changes: `extends = "demo.toml"`, relative to its folder.
EXTENDS_KEY = "extends"


def describe_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{where}: {message}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_config(data: Mapping[str, Any], settings: Sequence[str] = ()) -> RunConfig:
    """The run config `data` describes, with the `SECTION.FIELD=VALUE` changes of `settings`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config is a table of fields and sections, not a "
                          f"{type(data).__name__}")
    data = apply_settings(data, settings, RunConfig)
    former = former_names(data)
    if former:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(former))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def parse_host(settings: Sequence[str]) -> HostConfig:
    """Host settings from `host.FIELD=VALUE` changes alone (a peer that takes the rest of its
    config from the run's owner)."""
    others = [s for s in settings if not s.strip().startswith(f"{HOST_SECTION}.")]
    if others:
        raise ConfigError(f"--set {others[0]}: without --config, the run's settings come from "
                          f"its owner; --set may change {HOST_SECTION}.* only")
    return parse_config({}, settings).host


def section_names(model: type[BaseModel] = RunConfig) -> tuple[str, ...]:
    """The fields of `model` that are sections (tables of fields of their own)."""
    return tuple(name for name, field in model.model_fields.items()
                 if isinstance(field.annotation, type)
                 and issubclass(field.annotation, BaseModel))


def extend(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes`: a section of `changes` changes the base's section field by field;
    any field's value (an inline table such as task.options too) replaces the base's whole."""
    merged = dict(base)
    sections = section_names()
    for key, value in changes.items():
        inner = merged.get(key)
        if key in sections and isinstance(value, Mapping) and isinstance(inner, Mapping):
            merged[key] = {**inner, **value}
        else:
            merged[key] = value
    return merged


def parse_file(path: Path, parse: Callable[[str], Any], syntax: str,
               syntax_error: type[ValueError]) -> Any:
    """`parse` of the text of `path`, or a ConfigError that says what is wrong with the file."""
    try:
        return parse(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not a text file") from None
    except syntax_error as error:
        raise ConfigError(f"{path} is not valid {syntax}: {error}") from None


def read_toml(path: Path, extended_by: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The config in TOML file `path`, on top of the file it extends, if it names one."""
    data = parse_file(path, tomllib.loads, "TOML", tomllib.TOMLDecodeError)
    base_name = data.pop(EXTENDS_KEY, None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise ConfigError(f"{path}: {EXTENDS_KEY} must name a TOML file, got {base_name!r}")
    base_path = (path.parent / base_name).resolve()
    if base_path in (*extended_by, path.resolve()):
        raise ConfigError(f"{path}: {EXTENDS_KEY} = {base_name!r} comes back to a file that "
                          "extends it")
    check_file(base_path)
    return extend(read_toml(base_path, (*extended_by, path.resolve())), data)


def check_file(path: Path) -> None:
    if path.is_dir():
        hint = (f"; the config of the run in it is {path / 'config.json'}"
                if (path / "config.json").is_file() else "")
        raise ConfigError(f"config {path} is a folder, not a file: give a TOML file such as "
                          f"examples/demo.toml{hint}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")


def load_config(path: Path, settings: Sequence[str] = ()) -> RunConfig:
    """A TOML config, or the config.json a run folder holds, with the `SECTION.FIELD=VALUE`
    changes of `settings`."""
    check_file(path)
    if path.suffix == ".json":
        return parse_config(parse_file(path, json.loads, "JSON", json.JSONDecodeError), settings)
    return parse_config(read_toml(path), settings)
