"""An OpenEnv environment as a decentrl environment, "openenv:<module>:<Class>".

OpenEnv (the `openenv-core` package, the environment framework TRL uses) writes an environment as
a server-side class: `Environment.reset(seed=...)` gives the first Observation, `step(action)`
takes an Action and gives the next one, with `reward` and `done`; Action, Observation and State
are pydantic models. Such an environment normally runs as an HTTP server (often in a Docker image)
that a client (`EnvClient`, `from_docker_image`) talks to. The coordinator scores an episode by
replaying it (envs/base.py), so the environment must run here, in this process: the adapter
imports the server-side class named in the task name, builds it with `env_options`, and plays one
fresh instance per episode. What cannot be replayed is refused when the environment is built:

- a client, a URL, a Docker image or a Hub name (a network service: its answers are not the
  coordinator's to recompute);
- a class whose `reset` takes no seed (every episode would start alike, and a held-out split
  would hold the training problems);
- an environment whose first observation differs between two fresh instances reset with the same
  seed (not deterministic given the seed);
- an environment whose rubric asks a language model over the network (OpenEnv's `LLMJudge`).

An environment that is nondeterministic later in an episode is not detected here: the replay then
gives other observations than the rollout recorded, and the coordinator refuses the group.

Problems are reset seeds, drawn in their split by the hash of "seed:<seed>" (tasks/base.py), so a
held-out seed never appears in training. The episode's messages: a system prompt (`system_prompt`,
by default one describing the action's fields), the first observation as the user's message, then
each assistant turn and, until the environment is done, the observation it led to, as a user
message. Observations are rendered (`render_observation`, an import path "module:function" taking
the Observation; else the field `observation_field`; else the text of the Observation's one own
field, or its own fields as JSON) and cut to `max_observation_chars`.

Each assistant turn is one action: by default the JSON object in the reply (from its first "{"
to its last "}") validated as the environment's Action class; with `action_field`, the whole reply
(stripped) as that one field; or `parse_action`, an import path "module:function" taking the reply
and returning the Action (raising ValueError for a reply it cannot read). A reply that gives no
valid action, or an action the environment's `step` raises on, is not stepped: it is answered
with an "error: ..." observation, counts as an invalid call and costs `invalid_call_penalty` as
the turn's signal. The episode ends when an observation says `done` (stop reason "answer") or
after `max_turns` turns ("turn_limit"); its Reward's `correct` is the last observation's reward
(0 for none, or one that is not a finite number), so a reward of 1.0 or more counts as solved.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
import typing
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

from pydantic import BaseModel, ValidationError

from decentrl.envs.base import EnvStep, Message, RecordedAnswer, StopReason
from decentrl.tasks.arithmetic import check_int_option
from decentrl.tasks.base import (
    Problem,
    Reward,
    Split,
    check_heldout_fraction,
    draw_in_split,
    is_real,
)

OPENENV_PREFIX = "openenv:"
NAMING = (f"name an OpenEnv environment as {OPENENV_PREFIX}<module>:<Class>, its server-side "
          "Environment subclass (the class its server/app.py passes to create_app), importable "
          "here")
# The fields every OpenEnv Observation has; the default rendering shows the others.
OBSERVATION_BASE_FIELDS = frozenset({"done", "reward", "metadata"})
ACTION_BASE_FIELDS = frozenset({"metadata"})
MAX_TURNS_LIMIT = 64
MAX_ERROR_CHARS = 300  # an error observation quotes at most this much of an exception
IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
MODULE_PATH = re.compile(rf"{IDENTIFIER}(\.{IDENTIFIER})*")


class InvalidAction(ValueError):
    """A reply that gives no valid action; its message becomes the error observation."""


def refuse_unreplayable_form(target: str) -> None:
    """Refuse a URL, a Docker image or a Hub name: forms of an environment served elsewhere."""
    if "://" in target or "/" in target or target.startswith(("docker:", "hf:", "hub:")):
        raise ValueError(
            f"OpenEnv environment {target!r} is a URL, a Docker image or a Hub name: an "
            "environment served over the network, whose answers the coordinator cannot "
            f"recompute by replaying an episode; {NAMING}")


def imported_module(path: str, what: str) -> tuple[ModuleType, str]:
    """The module `path` ("module:name") names, imported, and the name in it."""
    module_name, _, name = path.partition(":")
    if not MODULE_PATH.fullmatch(module_name) or not re.fullmatch(IDENTIFIER, name):
        raise ValueError(f"{what} {path!r} is not an import path <module>:<name>")
    try:
        return importlib.import_module(module_name), name
    except ImportError as error:
        raise ValueError(f"{what} {path!r}: module {module_name!r} does not import ({error})"
                         ) from None


def import_attribute(path: str, what: str) -> Any:
    """The attribute `path` ("module:attribute") names."""
    module, name = imported_module(path, what)
    if not hasattr(module, name):
        raise ValueError(f"{what} {path!r}: module {module.__name__!r} has no {name!r}")
    return getattr(module, name)


def openenv_types() -> tuple[type, type, type]:
    """OpenEnv's Environment and Action base classes and its rubric `LLMJudge`, imported on use:
    openenv-core is an optional dependency (the `envs` extra)."""
    try:
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.types import Action
        from openenv.core.rubrics.llm_judge import LLMJudge
    except ImportError as error:
        raise ValueError(f"OpenEnv environments need openenv-core (pip install "
                         f"'decentrl[envs]'): {error}") from None
    return Environment, Action, LLMJudge


def environment_class_of(target: str) -> type:
    """The server-side OpenEnv Environment class `target` ("module:Class") names."""
    refuse_unreplayable_form(target)
    environment_base, _, _ = openenv_types()
    try:
        module, class_name = imported_module(target, "OpenEnv environment")
    except ValueError as error:
        raise ValueError(f"{error}; {NAMING}") from None
    found = getattr(module, class_name, None)
    if found is None:
        known = sorted(name for name, value in vars(module).items()
                       if isinstance(value, type) and issubclass(value, environment_base)
                       and not inspect.isabstract(value))
        raise ValueError(f"module {module.__name__!r} has no {class_name!r}; its OpenEnv "
                         f"environments: {', '.join(known) or 'none'}; {NAMING}")
    if isinstance(found, type) and issubclass(found, environment_base):
        if inspect.isabstract(found):
            raise ValueError(f"{target!r} is abstract; {NAMING}")
        return found
    from openenv.core.env_client import EnvClient
    from openenv.core.sync_client import SyncEnvClient

    if isinstance(found, type) and issubclass(found, (EnvClient, SyncEnvClient)):
        raise ValueError(f"{target!r} is an OpenEnv client: it talks to an environment served "
                         "over HTTP or from a Docker image, whose answers the coordinator cannot "
                         f"recompute by replaying an episode; {NAMING}")
    raise ValueError(f"{target!r} is not an OpenEnv Environment subclass; {NAMING}")


def action_class_of(environment_class: type, explicit: str | None) -> type[BaseModel]:
    """The environment's Action class: `explicit` ("module:Class"), else the annotation of
    `step`'s action, else the first type argument of its Environment[Action, ...] base."""
    _, action_base, _ = openenv_types()
    candidates: list[Any] = []
    if explicit is not None:
        candidates.append(import_attribute(explicit, "action_class"))
    else:
        try:
            hints = typing.get_type_hints(environment_class.step)
        except (NameError, TypeError):  # annotations that do not resolve: try the bases
            hints = {}
        candidates.append(hints.get("action"))
        for base in getattr(environment_class, "__orig_bases__", ()):
            candidates.extend(typing.get_args(base)[:1])
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, action_base):
            return candidate
    raise ValueError(f"cannot tell the Action class of {environment_class.__name__}: "
                     + ("action_class is not an OpenEnv Action subclass" if explicit else
                        "annotate its step's action, or give the option action_class "
                        "(<module>:<Class>)"))


def takes_parameter(function: Callable[..., Any], name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def bounded(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters cut]"


def own_fields(model: BaseModel, base_fields: frozenset[str]) -> dict[str, Any]:
    return {name: value for name, value in model.model_dump(mode="json").items()
            if name not in base_fields}


def default_render(observation: Any) -> str:
    """The text of an Observation's one own text field, else its own fields as JSON."""
    if not isinstance(observation, BaseModel):
        return str(observation)
    fields = own_fields(observation, OBSERVATION_BASE_FIELDS)
    if len(fields) == 1:
        [value] = fields.values()
        if isinstance(value, str):
            return value
    return json.dumps(fields, sort_keys=True, ensure_ascii=False)


def validation_summary(error: ValidationError) -> str:
    """The first problems pydantic found, without echoing the (model-written) input."""
    problems = [f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}"
                for e in error.errors()[:4]]
    return "; ".join(problems)


def action_fields_description(action_class: type[BaseModel]) -> str:
    """The Action's own fields as 'name (type)', the required ones marked."""
    schema = action_class.model_json_schema()
    required = set(schema.get("required", ()))
    described = []
    for name, field in schema.get("properties", {}).items():
        if name in ACTION_BASE_FIELDS:
            continue
        kind = field.get("type", "value")
        described.append(f'"{name}" ({kind}{", required" if name in required else ""})')
    return ", ".join(described)


class ActionParser:
    """The reply's action: a JSON object, one text field, or a user's parse function (see the
    module docstring). Raises InvalidAction, whose message the episode shows the model."""

    def __init__(self, action_class: type[BaseModel], action_field: str | None,
                 parse_action: str | None) -> None:
        if action_field is not None and parse_action is not None:
            raise ValueError("give at most one of action_field and parse_action")
        if action_field is not None and action_field not in action_class.model_fields:
            raise ValueError(f"action_field {action_field!r} is not a field of "
                             f"{action_class.__name__}; its fields: "
                             f"{', '.join(action_class.model_fields)}")
        self.action_class, self.action_field = action_class, action_field
        self.custom: Callable[[str], Any] | None = (
            None if parse_action is None else import_attribute(parse_action, "parse_action"))

    def describe(self) -> str:
        """How a reply writes an action, for the default system prompt."""
        if self.action_field is not None or self.custom is not None:
            return "plain text"
        return ("one JSON object with the fields "
                f"{action_fields_description(self.action_class)}")

    def __call__(self, reply: str) -> BaseModel:
        try:
            return self.action_class.model_validate(self.written(reply))
        except ValidationError as error:
            raise InvalidAction(f"not a valid action: {validation_summary(error)}") from None

    def written(self, reply: str) -> Any:
        """What the reply writes: an Action, or the fields to validate as one."""
        if self.custom is not None:
            try:
                return self.custom(reply)
            except Exception as error:  # noqa: BLE001 - a parse function's refusal, never a crash
                raise InvalidAction(bounded(f"{type(error).__name__}: {error}",
                                            MAX_ERROR_CHARS)) from None
        if self.action_field is not None:
            return {self.action_field: reply.strip()}
        start, end = reply.find("{"), reply.rfind("}")
        if start < 0 or end < start:
            raise InvalidAction("the reply holds no JSON object")
        try:
            return json.loads(reply[start:end + 1])
        except json.JSONDecodeError as error:
            raise InvalidAction(f"the JSON object does not parse ({error.msg})") from None


def reward_of(observation: Any) -> float:
    """An observation's reward as a finite float; 0.0 for none or a non-finite one."""
    value = getattr(observation, "reward", None)
    if isinstance(value, bool) or (is_real(value) and math.isfinite(value)):
        return float(value)
    return 0.0


class OpenEnvEpisode:
    """One episode on a fresh instance of the environment, reset with the problem's seed; the
    problem's question is the first observation, rendered."""

    def __init__(self, problem: Problem, instance: Any, system_prompt: str, parse: ActionParser,
                 render: Callable[[Any], str], max_turns: int, invalid_call_penalty: float,
                 reward: float) -> None:
        self.problem, self.instance = problem, instance
        self.parse, self.render = parse, render
        self.max_turns = self.max_tool_calls = max_turns  # every turn is one action
        self.invalid_call_penalty = invalid_call_penalty
        self.turns = self.tool_calls = self.invalid_calls = 0
        self.stop_reason: StopReason | None = None
        self.reward: Reward | None = None
        self.last_reward = reward  # the latest observation's, which scores a cut episode
        self._messages: list[Message] = [{"role": "system", "content": system_prompt},
                                         {"role": "user", "content": problem.question}]

    def messages(self) -> list[Message]:
        return [dict(message) for message in self._messages]

    def turn_prefix(self) -> str:
        return ""

    def step(self, reply: str) -> tuple[str, bool, float | None]:
        """The observation's text, whether it ends the episode, and the turn's signal."""
        try:
            action = self.parse(reply)
        except InvalidAction as error:
            self.invalid_calls += 1
            return f"error: {error}", False, -self.invalid_call_penalty
        try:
            observation = self.instance.step(action)
        except Exception as error:  # noqa: BLE001 - the environment refusing an action
            self.invalid_calls += 1
            cause = bounded(f"{type(error).__name__}: {error}", MAX_ERROR_CHARS)
            return (f"error: the environment could not take this action ({cause})", False,
                    -self.invalid_call_penalty)
        self.last_reward = reward_of(observation)
        return self.render(observation), bool(getattr(observation, "done", False)), None

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        if self.stop_reason is not None:
            raise RuntimeError(f"episode of problem {self.problem.index} is over "
                               f"({self.stop_reason})")
        self.turns += 1
        self.tool_calls += 1
        self._messages.append({"role": "assistant", "content": assistant_text})
        text, done, signal = self.step(assistant_text)
        if done or self.turns >= self.max_turns:
            self.stop_reason = "answer" if done else "turn_limit"
            self.reward = Reward(correct=self.last_reward, format=0.0)
            self.instance.close()
            return EnvStep(messages=[], done=True, reward=self.reward, turn_signal=signal)
        answer: list[Message] = [{"role": "user", "content": text}]
        self._messages.extend(answer)
        return EnvStep(messages=answer, done=False, reward=None, turn_signal=signal)


class OpenEnvEnvironment:
    """The OpenEnv environment `target` ("module:Class") as decentrl episodes; options in the
    module docstring, `env_options` are the class's constructor arguments."""

    def __init__(
        self,
        target: str,
        env_options: dict[str, Any] | None = None,
        heldout_fraction: float = 0.1,
        max_turns: int = 8,
        max_observation_chars: int = 4000,
        invalid_call_penalty: float = 0.1,
        system_prompt: str | None = None,
        action_class: str | None = None,
        action_field: str | None = None,
        parse_action: str | None = None,
        observation_field: str | None = None,
        render_observation: str | None = None,
    ) -> None:
        check_heldout_fraction(heldout_fraction)
        check_int_option("max_turns", max_turns, 1, MAX_TURNS_LIMIT)
        check_int_option("max_observation_chars", max_observation_chars, 1, 1_000_000)
        if not (is_real(invalid_call_penalty) and 0.0 <= invalid_call_penalty <= 1.0):
            raise ValueError(f"invalid_call_penalty must be in [0, 1], got "
                             f"{invalid_call_penalty!r}")
        if env_options is not None and not isinstance(env_options, dict):
            raise ValueError(f"env_options must be a table of the environment's constructor "
                             f"arguments, got {env_options!r}")
        if observation_field is not None and render_observation is not None:
            raise ValueError("give at most one of observation_field and render_observation")
        self.name = OPENENV_PREFIX + target
        self.environment_class = environment_class_of(target)
        if not takes_parameter(self.environment_class.reset, "seed"):
            raise ValueError(f"{target!r}: its reset takes no seed, so every episode would "
                             "start alike and a held-out split could not be kept apart")
        self.env_options = dict(env_options or {})
        self.heldout_fraction = heldout_fraction
        self.max_turns = max_turns
        self.max_observation_chars = max_observation_chars
        self.invalid_call_penalty = invalid_call_penalty
        self.parse = ActionParser(action_class_of(self.environment_class, action_class),
                                  action_field, parse_action)
        self.observation_field = observation_field
        self.custom_render: Callable[[Any], str] | None = (
            None if render_observation is None
            else import_attribute(render_observation, "render_observation"))
        self.system_prompt = system_prompt if system_prompt is not None else (
            "You act in an environment. Each of your replies is one action, written as "
            f"{self.parse.describe()}. The environment answers each action with an observation, "
            "until the episode ends.")
        self.check_replayable()

    def render(self, observation: Any) -> str:
        if self.custom_render is not None:
            text = str(self.custom_render(observation))
        elif self.observation_field is not None:
            text = str(getattr(observation, self.observation_field, ""))
        else:
            text = default_render(observation)
        return bounded(text, self.max_observation_chars)

    def started(self, seed: int) -> tuple[Any, Any]:
        """A fresh instance reset with `seed`, and its first observation."""
        instance = self.environment_class(**self.env_options)
        return instance, instance.reset(seed=seed)

    def check_replayable(self) -> None:
        """Refuse an environment the coordinator could not replay (the module docstring)."""
        _, _, llm_judge = openenv_types()
        seed = self.problem_seed("train", 0)
        first, observation = self.started(seed)
        second, again = self.started(seed)
        try:
            rubric = getattr(first, "rubric", None)
            rubrics = [] if rubric is None else [rubric, *rubric.rubrics()]
            if any(isinstance(part, llm_judge) for part in rubrics):
                raise ValueError(f"{self.name}: its rubric asks a language model (LLMJudge), a "
                                 "network service whose scores the coordinator cannot recompute")
            if self.render(observation) != self.render(again):
                raise ValueError(f"{self.name} is not deterministic given the seed: two fresh "
                                 f"instances reset with seed {seed} give different first "
                                 "observations, so the coordinator could not replay its episodes")
        finally:
            first.close()
            second.close()

    def drawn(self, split: Split, index: int) -> Problem:
        """The problem without its question: a seed, held out or not by its key's hash."""
        def candidate(seed: int) -> Problem:
            return Problem(task=self.name, index=index, question="", answer="",
                           key=f"seed:{seed}", metadata={"seed": seed})

        return draw_in_split(self.name, split, index, self.heldout_fraction, candidate)

    def problem_seed(self, split: Split, index: int) -> int:
        return int(self.drawn(split, index).metadata["seed"])

    def started_problem(self, split: Split, index: int) -> tuple[Problem, Any, Any]:
        """Problem (split, index) with its first observation as the question, the instance
        reset for it, and that observation."""
        drawn = self.drawn(split, index)
        instance, observation = self.started(drawn.metadata["seed"])
        return replace(drawn, question=self.render(observation)), instance, observation

    def problem(self, split: Split, index: int) -> Problem:
        problem, instance, _ = self.started_problem(split, index)
        instance.close()
        return problem

    def episode(self, split: Split, index: int) -> OpenEnvEpisode:
        problem, instance, observation = self.started_problem(split, index)
        return OpenEnvEpisode(problem, instance, self.system_prompt, self.parse, self.render,
                              self.max_turns, self.invalid_call_penalty, reward_of(observation))
