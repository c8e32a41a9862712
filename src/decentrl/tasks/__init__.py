"""Tasks: problems with a fixed train/held-out split, chat messages, answer extraction and rewards.

`make_task("sums", max_digits=3)` builds the built-in arithmetic task; `make_task("rg:<dataset>",
config={...})` adapts any reasoning-gym dataset; `make_task("dataset", path=...)` reads problems from
local files (tasks/dataset.py). TASK_NAMES lists the tasks we use and test. Any other name is looked
up among installed plug-ins (entry-point group "decentrl.tasks", decentrl/plugins.py).
"""

from __future__ import annotations

from typing import Any

from decentrl.plugins import (
    TASK_GROUP,
    Plugin,
    build_plugin,
    check_options,
    installed_plugins,
    plugin_names,
)
from decentrl.tasks.arithmetic import SumsTask
from decentrl.tasks.base import (
    SPLITS,
    Problem,
    Reward,
    Split,
    Task,
    problems,
    render_prompt,
    split_of,
)

REASONING_GYM_PREFIX = "rg:"
DATASET_TASK = "dataset"
TASK_NAMES: tuple[str, ...] = (
    "sums",
    DATASET_TASK,
    "rg:chain_sum",
    "rg:basic_arithmetic",
    "rg:countdown",
    "rg:gsm_symbolic",
)


def is_builtin_task(name: str) -> bool:
    return name in (SumsTask.name, DATASET_TASK) or name.startswith(REASONING_GYM_PREFIX)


def task_plugins() -> dict[str, Plugin]:
    """The installed task plug-ins by name (refused where a name collides: plugins.py)."""
    return installed_plugins(TASK_GROUP, is_builtin_task)


def is_task_name(name: str) -> bool:
    """Whether `make_task` knows `name`: a built-in's or an installed plug-in's."""
    return is_builtin_task(name) or name in task_plugins()


def known_tasks() -> str:
    """The tasks an unknown name's error lists."""
    return (f"{', '.join(TASK_NAMES)} (or {REASONING_GYM_PREFIX}<name> for any reasoning-gym "
            f"dataset){plugin_names(task_plugins())}")


def make_task(name: str, **options: Any) -> Task:
    """The task registered as `name`, built with `options` (each task's constructor arguments):
    a built-in, else an installed plug-in."""
    plugins = task_plugins()
    if name == SumsTask.name:
        task_class: type = SumsTask
        positional: tuple[str, ...] = ()
    elif name.startswith(REASONING_GYM_PREFIX):
        # Imported here because importing reasoning-gym takes about a second.
        from decentrl.tasks.reasoning_gym import ReasoningGymTask

        task_class = ReasoningGymTask
        positional = (name.removeprefix(REASONING_GYM_PREFIX),)
    elif name == DATASET_TASK:
        # Imported here: its checkers and the `datasets` library are only this task's.
        from decentrl.tasks.dataset import DatasetTask

        task_class = DatasetTask
        positional = ()
    elif name in plugins:
        return build_plugin(plugins[name], Task, options)
    else:
        raise ValueError(f"unknown task {name!r}; known tasks: {known_tasks()}")
    check_options("task", name, task_class, options, len(positional))
    return task_class(*positional, **options)


__all__ = [
    "SPLITS",
    "TASK_NAMES",
    "Problem",
    "Reward",
    "Split",
    "SumsTask",
    "Task",
    "is_builtin_task",
    "is_task_name",
    "known_tasks",
    "make_task",
    "problems",
    "render_prompt",
    "split_of",
    "task_plugins",
]
