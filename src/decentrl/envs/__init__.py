"""Environments: multi-turn episodes with tools, and any task as a one-turn environment.

`make_environment("agentic-calculator")` builds the word problems with a Python calculator tool,
`make_environment("agentic-countdown")` countdown with a checking tool, and
`make_environment("task:sums", max_digits=3)` any task of `decentrl.tasks` as one turn, and
`make_environment("verifiers:<env id>", env_args={...})` an environment written for the
`verifiers` library (envs/verifiers_env.py; the `envs` extra).
ENVIRONMENT_NAMES lists the environments we use and test. The two agentic ones are
`Demonstrating`: `play_demonstration(episode, environment.demonstration(problem, rng))` plays a
scripted ideal episode, for supervised warm-up.

A run trains on either: `make_task_or_environment` builds a Task for a task's name and an
Environment for an agentic one; rollout workers, ingestion and evaluation take both.
"""

from __future__ import annotations

import inspect
from typing import Any

from decentrl.envs.base import (
    Demonstrating,
    Environment,
    EnvStep,
    Episode,
    EpisodeResult,
    Message,
    StopReason,
    play_demonstration,
    run_episode,
)
from decentrl.envs.single_turn import TASK_ENVIRONMENT_PREFIX, TaskEnvironment
from decentrl.envs.verifiers_env import VERIFIERS_PREFIX, make_verifiers_environment
from decentrl.tasks import (
    REASONING_GYM_PREFIX,
    TASK_NAMES,
    Task,
    is_task_name,
    make_task,
)

# Multi-turn environments: a run whose task is one of these trains on episodes.
AGENTIC_ENVIRONMENTS: tuple[str, ...] = ("agentic-calculator", "agentic-countdown")
ENVIRONMENT_NAMES: tuple[str, ...] = (*AGENTIC_ENVIRONMENTS, "task:sums", "task:rg:chain_sum")


def make_environment(name: str, **options: Any) -> Environment:
    """The environment registered as `name`, built with `options` (its constructor arguments;
    for "task:<name>", the task's options)."""
    if name.startswith(TASK_ENVIRONMENT_PREFIX):
        return TaskEnvironment(make_task(name.removeprefix(TASK_ENVIRONMENT_PREFIX), **options))
    if name.startswith(VERIFIERS_PREFIX):
        return make_verifiers_environment(name, **options)
    # Imported here because both import reasoning-gym, which takes about two seconds.
    if name == "agentic-calculator":
        from decentrl.envs.calculator import CalculatorEnvironment

        environment_class: type = CalculatorEnvironment
    elif name == "agentic-countdown":
        from decentrl.envs.countdown import CountdownEnvironment

        environment_class = CountdownEnvironment
    else:
        raise ValueError(
            f"unknown environment {name!r}; known environments: {', '.join(ENVIRONMENT_NAMES)} "
            f"(or {TASK_ENVIRONMENT_PREFIX}<task name> for any task, {VERIFIERS_PREFIX}<env id> "
            "for a verifiers environment)"
        )
    known_options = list(inspect.signature(environment_class).parameters)
    for option in options:
        if option not in known_options:
            raise ValueError(
                f"environment {name!r} has no option {option!r}; its options: "
                f"{', '.join(known_options)}"
            )
    return environment_class(**options)


def make_task_or_environment(name: str, options: dict[str, Any]) -> Task | Environment:
    """What a run trains or evaluates on: the environment for an agentic name or a one-turn
    "task:<name>" adapter (trained as episodes), else the task itself."""
    if name in AGENTIC_ENVIRONMENTS or name.startswith((TASK_ENVIRONMENT_PREFIX,
                                                        VERIFIERS_PREFIX)):
        return make_environment(name, **options)
    if not is_task_name(name):
        raise ValueError(
            f"unknown task {name!r}; tasks: {', '.join(TASK_NAMES)} (or "
            f"{REASONING_GYM_PREFIX}<name> for any reasoning-gym dataset); multi-turn environments "
            f"with tools: {', '.join(AGENTIC_ENVIRONMENTS)} (or {TASK_ENVIRONMENT_PREFIX}<task> "
            f"for a task as one-turn episodes, {VERIFIERS_PREFIX}<env id> for a verifiers "
            "environment)"
        )
    return make_task(name, **options)


__all__ = [
    "AGENTIC_ENVIRONMENTS",
    "ENVIRONMENT_NAMES",
    "Demonstrating",
    "EnvStep",
    "Environment",
    "Episode",
    "EpisodeResult",
    "Message",
    "StopReason",
    "make_environment",
    "make_task_or_environment",
    "play_demonstration",
    "run_episode",
]
