"""Tasks: problems with a fixed train/held-out split, chat messages, answer extraction and rewards.

`make_task("sums", max_digits=3)` builds the built-in arithmetic task; `make_task("rg:<dataset>",
config={...})` adapts any reasoning-gym dataset; `make_task("dataset", path=...)` reads problems from
local files (tasks/dataset.py). TASK_NAMES lists the tasks we use and test.
"""

from __future__ import annotations

import inspect
from typing import Any

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


def is_task_name(name: str) -> bool:
    """Whether `make_task` knows `name`."""
    return name in (SumsTask.name, DATASET_TASK) or name.startswith(REASONING_GYM_PREFIX)


def make_task(name: str, **options: Any) -> Task:
    """The task registered as `name`, built with `options` (each task's constructor arguments)."""
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
    else:
        raise ValueError(
            f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)} "
            f"(or {REASONING_GYM_PREFIX}<name> for any reasoning-gym dataset)"
        )
    known_options = list(inspect.signature(task_class).parameters)[len(positional) :]
    for option in options:
        if option not in known_options:
            raise ValueError(
                f"task {name!r} has no option {option!r}; its options: {', '.join(known_options)}"
            )
    return task_class(*positional, **options)


__all__ = [
    "SPLITS",
    "TASK_NAMES",
    "Problem",
    "Reward",
    "Split",
    "SumsTask",
    "Task",
    "make_task",
    "problems",
    "render_prompt",
    "is_task_name",
    "split_of",
]
