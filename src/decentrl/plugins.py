"""Plug-ins: tasks and environments from other installed packages, found through entry points.

A package declares its tasks under the entry-point group "decentrl.tasks" and its environments
under "decentrl.environments", the entry's name being what a run's config names:

    [project.entry-points."decentrl.tasks"]
    count-letters = "my_package.letters:CountLettersTask"

The entry's object is a class or factory, called with the config's `task.options` as keyword
arguments (checked against its signature, as a built-in's are). What it builds must carry the
entry's name and have every member of the protocol (tasks/base.py `Task`, envs/base.py
`Environment`). examples/plugin-template is such a package; docs/plugins.md says how to write one.

Built-ins win: a name is looked up among plug-ins only after the built-ins. A plug-in whose name a
built-in has, or another plug-in has (in either group), is refused by every lookup, of a built-in's
name too, naming the distributions, so that an installed set never means two things. This module knows
neither the built-ins nor the protocols; tasks/ and envs/ pass them in.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from decentrl.errors import DecentrlError

log = logging.getLogger(__name__)

TASK_GROUP = "decentrl.tasks"
ENVIRONMENT_GROUP = "decentrl.environments"
GROUPS: tuple[str, ...] = (TASK_GROUP, ENVIRONMENT_GROUP)
# What each group's objects build, in errors.
KIND_OF_GROUP = {TASK_GROUP: "task", ENVIRONMENT_GROUP: "environment"}


class PluginError(DecentrlError, ValueError):
    """An installed plug-in cannot be used: its name is taken, it fails to import, or what it
    builds is not a task or environment."""


@dataclass(frozen=True)
class Plugin:
    entry_point: EntryPoint

    @property
    def name(self) -> str:
        return self.entry_point.name

    @property
    def kind(self) -> str:
        return KIND_OF_GROUP[self.entry_point.group]

    @property
    def distribution(self) -> str:
        """The installed package that declares it, "name version"."""
        dist = self.entry_point.dist
        return f"{dist.name} {dist.version}" if dist is not None else "an unnamed distribution"

    def __str__(self) -> str:
        entry = self.entry_point
        return f"{entry.group} entry point {entry.name} = {entry.value} ({self.distribution})"

    def load(self) -> Callable[..., Any]:
        """The class or factory the entry point names, imported."""
        try:
            loaded = self.entry_point.load()
        except Exception as error:  # a plug-in's import can raise anything; say whose it was
            raise PluginError(f"the {self.kind} plug-in {self} failed to load: "
                              f"{type(error).__name__}: {error}") from error
        if not callable(loaded):
            raise PluginError(f"the {self.kind} plug-in {self} is not a class or factory: it "
                              f"names a value of type {type(loaded).__name__}")
        return loaded


@functools.lru_cache(maxsize=8)
def _declared(search_path: tuple[str, ...]) -> tuple[Plugin, ...]:
    # Reading every installed distribution's metadata takes tens of milliseconds and runs and
    # tests build tasks often; keyed by the search path so that a changed sys.path reads afresh.
    return tuple(Plugin(entry) for group in GROUPS for entry in entry_points(group=group))


def installed_plugins(group: str, builtin: Callable[[str], bool]) -> dict[str, Plugin]:
    """The group's plug-ins by name. Refused, naming the distributions: a plug-in of either group
    whose name `builtin` says a built-in has, or that another plug-in has."""
    plugins: dict[str, Plugin] = {}
    for plugin in _declared(tuple(sys.path)):
        if builtin(plugin.name):
            raise PluginError(f"the {plugin.kind} plug-in {plugin} has the name of a decentrl "
                              "built-in; built-ins win, so rename the plug-in or uninstall "
                              f"{plugin.distribution}")
        if plugin.name in plugins:
            raise PluginError(f"two installed plug-ins are named {plugin.name!r}: "
                              f"{plugins[plugin.name]} and {plugin}; uninstall one of them")
        plugins[plugin.name] = plugin
    return {name: plugin for name, plugin in plugins.items()
            if plugin.entry_point.group == group}


def plugin_names(plugins: Mapping[str, Plugin]) -> str:
    """The installed plug-ins for an unknown name's error: "; installed plug-ins: a (dist 1.0)"."""
    if not plugins:
        return ""
    return "; installed plug-ins: " + ", ".join(
        f"{name} ({plugin.distribution})" for name, plugin in sorted(plugins.items()))


def check_options(kind: str, name: str, factory: Callable[..., Any], options: Iterable[str],
                  positional: int = 0) -> None:
    """Refuse an option `factory` has no parameter for (past its first `positional` ones, which
    the registry fills), listing those it has: the options of built-ins and plug-ins alike."""
    known = list(inspect.signature(factory).parameters)[positional:]
    for option in options:
        if option not in known:
            raise ValueError(f"{kind} {name!r} has no option {option!r}; its options: "
                             f"{', '.join(known) or 'none'}")


def missing_members(built: object, protocol: type) -> list[str]:
    """The attributes and methods a Protocol class declares that `built` lacks (a method counts
    as missing unless callable)."""
    attributes = set(getattr(protocol, "__annotations__", {}))
    methods = {name for name, value in vars(protocol).items()
               if callable(value) and not name.startswith("_")}
    return sorted([name for name in attributes if not hasattr(built, name)]
                  + [name for name in methods if not callable(getattr(built, name, None))])


def build_plugin(plugin: Plugin, protocol: type, options: Mapping[str, Any]) -> Any:
    """What the plug-in builds with `options`, refused unless it has every member of `protocol`
    and carries the plug-in's name (which seeds its problems and names it in every record)."""
    factory = plugin.load()
    check_options(plugin.kind, plugin.name, factory, options)
    built = factory(**options)
    missing = missing_members(built, protocol)
    if missing:
        raise PluginError(f"the {plugin.kind} plug-in {plugin} built a {type(built).__name__}, "
                          f"which is not a {plugin.kind}: it has no {', '.join(missing)}")
    if built.name != plugin.name:
        raise PluginError(f"the {plugin.kind} plug-in {plugin} built a {plugin.kind} named "
                          f"{built.name!r}; it must carry its entry point's name")
    # The run's config names the plug-in, not its version: the log says which one built it.
    log.info("the %s %r comes from the plug-in %s", plugin.kind, plugin.name, plugin)
    return built
