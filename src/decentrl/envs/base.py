"""The environment protocol: episodes that alternate assistant turns and environment responses.

An Environment makes Episodes the way a Task makes Problems: `episode(split, index)` is a pure
function of (split, index), and the problem behind it comes from `draw_in_split`, so a held-out
episode never appears in training. An Episode works on text: `messages()` is the conversation so
far (system prompt with the tool descriptions, then the user's question, then the turns), and
`respond(assistant_text)` records one assistant turn and answers with an EnvStep: the messages
the environment appends (tool results or error observations), whether the episode is over, the
final reward once it is, and an optional per-turn signal.

Every episode ends within `max_turns` assistant turns, so `run_episode` always terminates.

An environment that is also `Demonstrating` can play its own problems: `demonstration` writes the
assistant turns of an ideal episode (scripted, with varied wording), and `play_demonstration` runs
them through an episode to give the whole transcript, for supervised warm-up data.

The coordinator scores an episode by replaying it: a fresh episode hears the rollout's assistant
turns and must answer exactly what the rollout recorded. An answer that depends on the machine (a
tool call's CPU budget, envs/budget.py) is resolved at replay with `RecordedAnswer`: the episode
may ask whether an answer it could equally give is the recorded one, and give that one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from decentrl.tasks.base import Problem, Reward, Split

Message = dict[str, str]  # {"role": ..., "content": ...}, as chat templates take them
# Why an episode ended: a reply without a tool call (the final answer), or a limit.
StopReason = Literal["answer", "turn_limit", "tool_call_limit"]
# At replay: whether these messages, appended after the current turn, are what the rollout
# recorded. Asked during `respond`, once the turn is counted.
RecordedAnswer = Callable[[list[Message]], bool]


@dataclass(frozen=True)
class EnvStep:
    messages: list[Message]  # what the environment appends after the turn; empty when done
    done: bool
    reward: Reward | None  # the final reward when done, else None
    turn_signal: float | None  # a shaping signal for this turn; None where the env gives none


class Episode(Protocol):
    problem: Problem
    max_turns: int  # assistant turns
    max_tool_calls: int  # tool calls over the whole episode, malformed ones included
    turns: int
    tool_calls: int  # every call the assistant attempted, malformed ones included
    invalid_calls: int  # the malformed ones: answered with an error observation, not run
    stop_reason: StopReason | None  # None while the episode runs
    reward: Reward | None  # None while the episode runs

    def messages(self) -> list[Message]:
        """A copy of the conversation so far; the last message is never the assistant's while
        the episode runs, so it is always the assistant's turn next."""
        ...

    def turn_prefix(self) -> str:
        """The text the next assistant turn starts with, written by the environment (assistant
        prefill; "" for none). The model writes the rest of the turn after it."""
        ...

    def respond(self, assistant_text: str, recorded: RecordedAnswer | None = None) -> EnvStep:
        """Record one assistant turn (its prefix included). Never raises on any text; raises
        once the episode is over. `recorded` is given at the coordinator's replay only (see the
        module docstring); an episode whose answers never depend on the machine ignores it."""
        ...


@runtime_checkable
class Environment(Protocol):
    name: str

    def problem(self, split: Split, index: int) -> Problem:
        """The problem behind episode (split, index)."""
        ...

    def episode(self, split: Split, index: int) -> Episode:
        """A fresh episode; the same (split, index) always starts the same conversation."""
        ...


@runtime_checkable
class Demonstrating(Environment, Protocol):
    """An environment that can play its own problems."""

    def demonstration(self, problem: Problem, rng: random.Random) -> list[str]:
        """The assistant turns of an ideal episode of `problem`, wording drawn from `rng`: each
        turn's full text, the episode's `turn_prefix` included; each turn but the last ends with
        one tool call, the last answers. `play_demonstration` plays them."""
        ...


@dataclass(frozen=True)
class EpisodeResult:
    problem: Problem
    messages: list[Message]  # the whole conversation, the assistant's turns included
    reward: Reward
    turns: int
    tool_calls: int
    invalid_calls: int
    turn_signals: list[float | None]  # one per assistant turn
    stop_reason: StopReason


def run_episode(episode: Episode, policy: Callable[[list[Message]], str]) -> EpisodeResult:
    """Play an episode to its end: `policy` reads the conversation and writes the next turn
    (after the episode's `turn_prefix`)."""
    turn_signals: list[float | None] = []
    while True:
        prefix = episode.turn_prefix()
        step = episode.respond(prefix + policy(episode.messages()))
        turn_signals.append(step.turn_signal)
        if step.done:
            break
    assert step.reward is not None and episode.stop_reason is not None  # done says so
    return EpisodeResult(
        problem=episode.problem,
        messages=episode.messages(),
        reward=step.reward,
        turns=episode.turns,
        tool_calls=episode.tool_calls,
        invalid_calls=episode.invalid_calls,
        turn_signals=turn_signals,
        stop_reason=episode.stop_reason,
    )


def play_demonstration(episode: Episode, turns: Sequence[str]) -> EpisodeResult:
    """Play scripted `turns` (each a turn's full text, its prefix included) through `episode`,
    which must end exactly at the last one."""
    remaining = list(turns)

    def scripted(messages: list[Message]) -> str:
        if not remaining:
            raise ValueError(f"the episode of problem {episode.problem.index} goes on after the "
                             f"{len(turns)} turns of its demonstration")
        turn, prefix = remaining.pop(0), episode.turn_prefix()
        if not turn.startswith(prefix):
            raise ValueError(f"turn {episode.turns + 1} of the demonstration does not start with "
                             f"the episode's prefill {prefix!r}")
        return turn[len(prefix):]

    result = run_episode(episode, scripted)
    if remaining:
        raise ValueError(f"the episode of problem {episode.problem.index} ended "
                         f"({result.stop_reason}) after {result.turns} of the {len(turns)} "
                         "turns of its demonstration")
    return result
