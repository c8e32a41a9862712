"""Which `verifiers` environments decentrl can replay, and the private event loop that runs them.

The coordinator never trusts a peer's reward: it replays each episode from its tokens and scores
it itself (rollout/episodes.py). An environment therefore qualifies only if its answers and its
reward are a function of the transcript, computed here without reaching anything outside. What
can be seen from the objects is refused when the environment is loaded (`refusal_reasons`):

- anything but a `MultiTurnEnv` (a `SingleTurnEnv` is one): `EnvGroup` and custom rollout loops
  are not driven turn by turn;
- `ToolEnv` and its kin (`StatefulToolEnv`, `SandboxEnv`, `PythonEnv`, `MCPEnv`) and any
  environment with tool definitions: their tools are called through structured API tool calls
  that a text turn does not carry, and they run arbitrary code, often a remote sandbox;
- a `JudgeRubric`, or any rubric or environment holding a network client (OpenAI, Anthropic,
  httpx, requests, aiohttp, a verifiers client): a judge model's verdict is neither local nor
  reproducible;
- group reward functions (their score depends on the other rollouts of the group, which a
  replay of one episode does not see), and rubrics that replace `score_rollout`.

What cannot be seen, a reward function that draws random numbers or reads the clock, is caught
by a probe when the environment is built (verifiers_env.py): episodes played twice on the same
transcript must give the same messages and reward. Code that quietly calls a network service
and answers consistently is not detected; naming an environment vouches that it does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from decentrl.errors import DecentrlError

T = TypeVar("T")
# Top-level packages whose objects talk to a network service.
NETWORK_PACKAGES = frozenset({"openai", "anthropic", "httpx", "requests", "aiohttp"})


class UnreplayableEnvironment(DecentrlError, ValueError):
    """A verifiers environment whose episodes the coordinator could not replay and score."""


class EnvironmentFailure(DecentrlError, RuntimeError):
    """The environment's code raised or ran out of time during an episode."""


def network_holders(owner: object) -> Iterator[str]:
    """The attributes of `owner` (one level into lists, tuples and dicts) holding a network
    client."""
    import verifiers as vf

    for name, value in vars(owner).items():
        values = (list(value.values()) if isinstance(value, dict) else
                  list(value) if isinstance(value, (list, tuple)) else [value])
        for held in values:
            package = type(held).__module__.split(".")[0]
            if package in NETWORK_PACKAGES or isinstance(held, vf.Client):
                yield f"{type(owner).__name__}.{name} holds a {type(held).__name__}"
                break


def leaf_rubrics(rubric: Any) -> Iterator[Any]:
    import verifiers as vf

    if isinstance(rubric, vf.RubricGroup):
        for member in rubric.rubrics:
            yield from leaf_rubrics(member)
    else:
        yield rubric


def refusal_reasons(env: Any) -> list[str]:
    """Why the coordinator could not replay and score `env`'s episodes; empty when it can."""
    import verifiers as vf

    if not isinstance(env, vf.MultiTurnEnv):
        return [f"{type(env).__name__} is not a MultiTurnEnv (or SingleTurnEnv); decentrl "
                "drives an environment turn by turn through env_response and is_completed"]
    reasons = []
    if isinstance(env, vf.ToolEnv) or env.tool_defs:
        reasons.append(f"{type(env).__name__} calls tools through structured API tool calls, "
                       "which decentrl's text turns do not carry, and runs arbitrary tool code; "
                       "decentrl's own tool environments run their tools in its sandbox")
    if env.message_type != "chat":
        reasons.append(f"message_type {env.message_type!r}: only chat environments are adapted")
    reasons += network_holders(env)
    for rubric in leaf_rubrics(env.rubric):
        kind = type(rubric).__name__
        if isinstance(rubric, vf.JudgeRubric):
            reasons.append(f"{kind} asks a judge model for the reward, which the coordinator "
                           "cannot reproduce offline")
        elif type(rubric).score_rollout is not vf.Rubric.score_rollout:
            reasons.append(f"{kind} replaces score_rollout; decentrl scores an episode with "
                           "the rubric's reward functions and weights")
        if rubric.has_group_rewards:
            reasons.append(f"{kind} has group reward functions, whose score depends on other "
                           "rollouts that the replay of one episode does not see")
        reasons += network_holders(rubric)
        reasons += (f"{kind}'s class object {name!r} is a {type(held).__name__}"
                    for name, held in rubric.class_objects.items()
                    if type(held).__module__.split(".")[0] in NETWORK_PACKAGES)
    return list(dict.fromkeys(reasons))  # a judge's client shows up twice


class EventLoopThread:
    """A private event loop on a daemon thread: the environment's async code runs there, and the
    caller waits a bounded time. A call that overruns is cancelled where it awaits; one stuck in
    synchronous code keeps the loop busy, so the calls after it time out too (each reward 0)
    instead of hanging the caller."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"verifiers-{name}",
                         daemon=True).start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        """The coroutine's result; EnvironmentFailure if it raises or takes over `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EnvironmentFailure(f"{what} took over {timeout_s:g} s") from None
        except Exception as error:
            raise EnvironmentFailure(f"{what} raised {type(error).__name__}: {error}") from error
