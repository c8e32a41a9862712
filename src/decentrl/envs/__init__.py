"""Environments: multi-turn episodes with tools, and any task as a one-turn environment.

`make_environment("agentic-calculator")` builds the word problems with a Python calculator tool,
`make_environment("agentic-countdown")` countdown with a checking tool, and
`make_environment("task:sums", max_digits=3)` any task of `decentrl.tasks` as one turn,
`make_environment("verifiers:<env id>", env_args={...})` an environment written for the
`verifiers` library (envs/verifiers_env.py) and `make_environment("openenv:<module>:<Class>",
env_options={...})` an OpenEnv environment run in this process (envs/openenv_env.py); both need
the `envs` extra.
ENVIRONMENT_NAMES lists the environments we use and test. The two agentic ones are
`Demonstrating`: `play_demonstration(episode, environment.demonstration(problem, rng))` plays a
scripted ideal episode, for supervised warm-up.

A run trains on either: `make_task_or_environment` builds a Task for a task's name and an
Environment for an agentic one; rollout workers, ingestion and evaluation take both. Names no
built-in has are looked up among installed plug-ins (entry-point groups "decentrl.environments"
and "decentrl.tasks", decentrl/plugins.py).
"""

from __future__ import annotations

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
from decentrl.envs.openenv_env import OPENENV_PREFIX, OpenEnvEnvironment
from decentrl.envs.single_turn import TASK_ENVIRONMENT_PREFIX, TaskEnvironment
from decentrl.envs.verifiers_env import VERIFIERS_PREFIX, make_verifiers_environment
from decentrl.plugins import (
    ENVIRONMENT_GROUP,
    Plugin,
    build_plugin,
    check_options,
    installed_plugins,
    plugin_names,
)
from decentrl.tasks import Task, is_builtin_task, is_task_name, known_tasks, make_task

# Multi-turn environments: a run whose task is one of these trains on episodes.
AGENTIC_ENVIRONMENTS: tuple[str, ...] = ("agentic-calculator", "agentic-countdown")
ENVIRONMENT_NAMES: tuple[str, ...] = (*AGENTIC_ENVIRONMENTS, "task:sums", "task:rg:chain_sum")


def is_builtin_environment(name: str) -> bool:
    return name in AGENTIC_ENVIRONMENTS or name.startswith((TASK_ENVIRONMENT_PREFIX,
                                                            VERIFIERS_PREFIX, OPENENV_PREFIX))


def environment_plugins() -> dict[str, Plugin]:
    """The installed environment plug-ins by name (refused where a name collides with a built-in
    task or environment, or another plug-in: plugins.py)."""
    return installed_plugins(ENVIRONMENT_GROUP,
                             lambda name: is_builtin_environment(name) or is_builtin_task(name))


def make_environment(name: str, **options: Any) -> Environment:
    """The environment registered as `name`, built with `options` (its constructor arguments;
    for "task:<name>", the task's options; for "openenv:<module>:<Class>", the adapter's, with
    the class's own under `env_options`): a built-in, else an installed plug-in."""
    if name.startswith(TASK_ENVIRONMENT_PREFIX):
        return TaskEnvironment(make_task(name.removeprefix(TASK_ENVIRONMENT_PREFIX), **options))
    if name.startswith(VERIFIERS_PREFIX):
        return make_verifiers_environment(name, **options)
    plugins = environment_plugins()
    if name.startswith(OPENENV_PREFIX):
        environment_class: type = OpenEnvEnvironment
        options = {**options, "target": name.removeprefix(OPENENV_PREFIX)}
    elif name == "agentic-calculator":
        # Imported here because both import reasoning-gym, which takes about two seconds.
        from decentrl.envs.calculator import CalculatorEnvironment

        environment_class = CalculatorEnvironment
    elif name == "agentic-countdown":
        from decentrl.envs.countdown import CountdownEnvironment

        environment_class = CountdownEnvironment
    elif name in plugins:
        return build_plugin(plugins[name], Environment, options)
    else:
        raise ValueError(
            f"unknown environment {name!r}; known environments: {', '.join(ENVIRONMENT_NAMES)} "
            f"(or {TASK_ENVIRONMENT_PREFIX}<task name> for any task, {VERIFIERS_PREFIX}<env id> "
            f"for a verifiers environment, or {OPENENV_PREFIX}<module>:<Class> for an OpenEnv "
            f"environment){plugin_names(plugins)}"
        )
    check_options("environment", name, environment_class, options)
    return environment_class(**options)


def make_task_or_environment(name: str, options: dict[str, Any]) -> Task | Environment:
    """What a run trains or evaluates on: the environment for an agentic name, a one-turn
    "task:<name>" adapter (trained as episodes), a verifiers or OpenEnv environment or an
    environment plug-in, else the task itself."""
    if is_builtin_environment(name) or name in environment_plugins():
        return make_environment(name, **options)
    if not is_task_name(name):
        raise ValueError(
            f"unknown task {name!r}; tasks: {known_tasks()}; multi-turn environments with tools: "
            f"{', '.join(AGENTIC_ENVIRONMENTS)} (or {TASK_ENVIRONMENT_PREFIX}<task> for a task "
            f"as one-turn episodes, {VERIFIERS_PREFIX}<env id> for a verifiers environment, "
            f"{OPENENV_PREFIX}<module>:<Class> for an OpenEnv environment)"
            f"{plugin_names(environment_plugins())}"
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
    "environment_plugins",
    "is_builtin_environment",
    "make_environment",
    "make_task_or_environment",
    "play_demonstration",
    "run_episode",
]
