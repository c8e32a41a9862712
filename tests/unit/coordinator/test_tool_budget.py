"""An episode's tool calls share a CPU budget, at generation and at the coordinator's replay: once
it is spent no call runs and each answers the budget's error; the replay refuses the calls the
rollout recorded as refused without running them, so both agree on the transcript; a rollout that
claims more runs than the replay allows is refused, at a cost bounded by the replay's limit."""

from __future__ import annotations

import json
import math
import string
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from decentrl.config import RunConfig
from decentrl.coordinator.ingest import Ingestion, RejectedGroup
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.envs import make_environment, sandbox
from decentrl.envs.budget import REPLAY_ALLOWANCE, ToolBudget
from decentrl.envs.calculator import PYTHON_TOOL, CalculatorEnvironment
from decentrl.envs.sandbox import ToolResult
from decentrl.envs.sandbox_child import CPU_TIMER_MARGIN_S
from decentrl.envs.tool_calls import CLOSE_TAG, ToolEpisode
from decentrl.model.tiny import tiny_tokenizer
from decentrl.rollout.episodes import EpisodeTokens, replay_episode
from decentrl.rollout.types import Rollout, RolloutGroup, VersionSpan
from decentrl.tasks.base import Problem, Split

# A tool call's JSON needs punctuation the default tiny vocabulary lacks.
TOKENIZER = tiny_tokenizer(string.digits + string.ascii_letters + string.punctuation + " \n")
CALL_TIMEOUT_S = 0.2  # per call, in place of the default second: the tests burn less
BUDGET_S = 0.5
# One comparison of 10**12 items: it never returns to the interpreter, so only the child's CPU
# timer stops it, at CALL_TIMEOUT_S + CPU_TIMER_MARGIN_S of CPU time: each such call costs at
# least that, which bounds how many the budget lets run whatever the machine.
NESTED = "[[[0] * 10**4] * 10**4] * 10**4"
BURN = f"{NESTED} == {NESTED}"
MIN_BURN_CPU_S = CALL_TIMEOUT_S + CPU_TIMER_MARGIN_S
# What the budget cannot stop: the last call's timer margin and its interpreter's startup.
OVERSHOOT_S = 0.3
BURNING_TURNS = 5
REFUSAL = f"error: tool budget of {BUDGET_S:g} s for this episode is spent"
TIMEOUT = f"error: timeout: took longer than {CALL_TIMEOUT_S} s"


@pytest.fixture(scope="module", autouse=True)
def cpu_timer_first() -> Iterator[None]:
    """A watchdog that waits long enough for the child's CPU timer to stop a burning call even on
    a busy machine, so that every such call costs at least MIN_BURN_CPU_S."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sandbox, "STARTUP_ALLOWANCE_S", 30.0)
        yield


def python_call(expression: str) -> str:
    call = json.dumps({"name": "python", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n{CLOSE_TAG}"


class CalculatorWithShortCalls:
    """The calculator environment with CALL_TIMEOUT_S per call; it keeps every episode it makes,
    to read their budgets after the coordinator replayed them."""

    def __init__(self, tool_budget_s: float = BUDGET_S) -> None:
        self.inner = CalculatorEnvironment(max_turns=8, max_tool_calls=8,
                                           tool_budget_s=tool_budget_s)
        self.name = self.inner.name
        self.episodes: list[ToolEpisode] = []

    def problem(self, split: Split, index: int) -> Problem:
        return self.inner.problem(split, index)

    def episode(self, split: Split, index: int) -> ToolEpisode:
        episode = self.inner.episode(split, index)
        episode.tool_budget.call_timeout_s = CALL_TIMEOUT_S
        self.episodes.append(episode)
        return episode


def generate(episode: ToolEpisode, turns: list[str]) -> Rollout:
    """The rollout of `episode` with `turns` as the model's, played as the rollout worker plays
    it: a turn that ends with a call stops at its closing tag, any other at the end-of-turn
    token, and the environment's answer is forced in after each."""
    driver = EpisodeTokens(episode, TOKENIZER)
    prompt = driver.prompt()
    completion: list[int] = []
    generated: list[bool] = []
    for turn in turns:
        tokens = TOKENIZER.encode(turn, add_special_tokens=False)
        if not turn.endswith(CLOSE_TAG):
            tokens.append(TOKENIZER.eos_token_id)
        completion += tokens
        generated += [True] * len(tokens)
        forced = driver.turn_ended(completion)
        if forced is None:
            break
        completion += forced
        generated += [False] * len(forced)
    return Rollout(prompt_tokens=prompt, completion_tokens=completion,
                   behaviour_logprobs=[-0.5 if g else 0.0 for g in generated],
                   finished=episode.stop_reason is not None, generated=generated)


def group_of(rollouts: list[Rollout]) -> RolloutGroup:
    return RolloutGroup(group_id="g", task="agentic-calculator", problem_index=0,
                        stage_versions=[0, 0], sampling_seed=0, rollouts=rollouts,
                        version_spans=[VersionSpan(start=0, versions=[0, 0])])


def ingestion_of(environment: CalculatorWithShortCalls) -> Ingestion:
    return Ingestion(RunConfig(), environment, TOKENIZER, PromptScheduler(0))


def tool_messages(episode: ToolEpisode) -> list[str]:
    return [m["content"].split("\n")[0] for m in episode.messages() if m["role"] == "tool"]


# --- the accounting ---------------------------------------------------------------------------


def costing(cpu_s: float, granted: list[float]) -> Any:
    """A tool call that needs `cpu_s` CPU seconds: it answers if its limit allows that, else it
    is stopped at its limit; it notes each limit it is given."""

    def call(limit_s: float) -> ToolResult:
        granted.append(limit_s)
        if cpu_s <= limit_s:
            return ToolResult(ok=True, output="42", error=None, cpu_s=cpu_s)
        return ToolResult(ok=False, output="", error=f"timeout: took longer than {limit_s} s",
                          cpu_s=limit_s, timed_out=True)

    return call


def test_each_call_gets_what_is_left_and_none_runs_once_the_budget_is_spent() -> None:
    budget, granted = ToolBudget(1.0), []
    budget.call_timeout_s = 0.4
    results = [budget.run(costing(0.3, granted), replaying=False) for _ in range(5)]
    # Three calls of 0.3 s; the fourth has 0.1 s left, is stopped there and answers the budget's
    # error, not a timeout naming a limit that depends on what this machine measured.
    assert granted == pytest.approx([0.4, 0.4, 0.4, 0.1])
    assert [r.output for r in results[:3]] == ["42"] * 3
    assert [r.error for r in results[3:]] == ["tool budget of 1 s for this episode is spent"] * 2
    assert budget.calls_run == 4 and budget.exhausted
    assert budget.spent_s == pytest.approx(1.0)


def test_a_call_stopped_at_its_own_limit_is_a_timeout_and_the_budget_goes_on() -> None:
    budget, granted = ToolBudget(2.0), []
    budget.call_timeout_s = 0.4
    first = budget.run(costing(5.0, granted), replaying=False)
    assert first.error == "timeout: took longer than 0.4 s" and not budget.exhausted
    assert budget.run(costing(0.1, granted), replaying=False).ok
    assert granted == [0.4, 0.4]


def test_the_replay_may_spend_its_allowance_before_it_refuses() -> None:
    generation, replay = ToolBudget(1.0), ToolBudget(1.0)
    ran = [sum(budget.run(costing(0.25, []), replaying=replaying).ok for _ in range(20))
           for budget, replaying in ((generation, False), (replay, True))]
    assert ran == [4, int(4 * REPLAY_ALLOWANCE)]
    assert replay.spent_s == pytest.approx(REPLAY_ALLOWANCE * generation.spent_s)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "2", 3601])
def test_the_budget_option_is_checked(value: object) -> None:
    for name in ("agentic-calculator", "agentic-countdown"):
        with pytest.raises(ValueError, match=r"^tool_budget_s must be a number of CPU seconds "
                                             r"in \(0, 3600\], got "):
            make_environment(name, tool_budget_s=value)
    episode = make_environment("agentic-countdown", tool_budget_s=0.5).episode("train", 0)
    assert episode.tool_budget.seconds == 0.5  # type: ignore[attr-defined]


# --- episodes, generated and replayed -------------------------------------------------------------


def test_an_honest_episode_is_unaffected() -> None:
    environment = CalculatorWithShortCalls()
    episode = environment.episode("train", 0)
    rollout = generate(episode, [python_call("12 * 34"), python_call("408 - 8"),
                                 f"<answer>{episode.problem.answer}</answer>"])
    assert tool_messages(episode) == ["408", "400"]
    assert episode.reward is not None and episode.reward.solved
    assert episode.tool_budget.calls_run == 2 and not episode.tool_budget.exhausted
    assert 0.0 < episode.tool_budget.spent_s < BUDGET_S
    replayed = replay_episode(environment.episode("train", 0), TOKENIZER, rollout).episode
    assert replayed.messages() == episode.messages() and replayed.reward == episode.reward


@pytest.fixture(scope="module")
def burning() -> tuple[list[ToolEpisode], list[Rollout]]:
    """Three episodes whose every turn is a call that burns CPU until it is stopped."""
    environment = CalculatorWithShortCalls()
    episodes = [environment.episode("train", 0) for _ in range(3)]
    turns = [python_call(BURN)] * BURNING_TURNS + ["<answer>0</answer>"]
    return episodes, [generate(episode, turns) for episode in episodes]


def test_a_burning_episode_stops_running_tools_once_its_budget_is_spent(
        burning: tuple[list[ToolEpisode], list[Rollout]]) -> None:
    [episode, *_], [rollout, *_] = burning
    budget = episode.tool_budget
    # Every call costs at least MIN_BURN_CPU_S, so at most two fit in the budget on any machine.
    assert 1 <= budget.calls_run <= BUDGET_S // MIN_BURN_CPU_S == 2
    assert budget.exhausted and budget.spent_s <= BUDGET_S + OVERSHOOT_S
    messages = tool_messages(episode)
    assert len(messages) == BURNING_TURNS
    assert all(m in (TIMEOUT, REFUSAL) for m in messages[:budget.calls_run])
    assert messages[budget.calls_run:] == [REFUSAL] * (BURNING_TURNS - budget.calls_run)
    # A refused call is a valid call whose tool failed: no invalid-call penalty.
    assert episode.invalid_calls == 0 and episode.stop_reason == "answer"

    replayed = replay_episode(CalculatorWithShortCalls().episode("train", 0), TOKENIZER, rollout)
    assert replayed.episode.messages() == episode.messages()
    assert replayed.turn_signals == [0.0] * (BURNING_TURNS + 1)
    # The replay ran the calls the rollout answered with their tool's result, and refused the
    # others without running them, the one the budget cut at generation included.
    replay_budget = replayed.episode.tool_budget  # type: ignore[attr-defined]
    assert replay_budget.calls_run == messages.count(TIMEOUT) >= 1
    assert replay_budget.spent_s <= REPLAY_ALLOWANCE * BUDGET_S + OVERSHOOT_S


def test_the_coordinator_replays_a_group_within_its_budget(
        burning: tuple[list[ToolEpisode], list[Rollout]]) -> None:
    episodes, rollouts = burning
    environment = CalculatorWithShortCalls()
    scored = ingestion_of(environment).score(group_of(rollouts))
    assert scored.rewards == [0.0] * len(rollouts)
    budgets = [episode.tool_budget for episode in environment.episodes]
    assert [b.calls_run for b in budgets] == [tool_messages(e).count(TIMEOUT) for e in episodes]
    # At most the group's size times the replay's limit per episode, whatever the rollouts say.
    assert sum(b.calls_run for b in budgets) <= len(rollouts) * 2
    assert sum(b.spent_s for b in budgets) <= \
        len(rollouts) * (REPLAY_ALLOWANCE * BUDGET_S + OVERSHOOT_S)


def test_a_rollout_that_claims_more_runs_than_the_replay_allows_is_refused() -> None:
    # A hostile peer's episode: its tool answers every burning call with a timeout at once,
    # without a budget, so its transcript claims six calls that each ran to their limit.
    forged = CalculatorWithShortCalls(tool_budget_s=3600).episode("train", 0)
    forged.tools["python"] = replace(PYTHON_TOOL, run=lambda arguments, limit_s: ToolResult(
        ok=False, output="", error=f"timeout: took longer than {CALL_TIMEOUT_S} s"))
    claims = 6
    rollout = generate(forged, [python_call(BURN)] * claims + ["<answer>0</answer>"])
    assert tool_messages(forged) == [TIMEOUT] * claims

    environment = CalculatorWithShortCalls()
    with pytest.raises(RejectedGroup, match="not what the environment answers"):
        ingestion_of(environment).score(group_of([rollout]))
    [replay] = [episode.tool_budget for episode in environment.episodes]
    limit_s = REPLAY_ALLOWANCE * BUDGET_S
    assert replay.calls_run <= limit_s // MIN_BURN_CPU_S < claims
    assert replay.spent_s <= limit_s + OVERSHOOT_S


def test_a_refusal_the_rollout_claims_is_adopted_without_running_the_call() -> None:
    # A peer may claim its budget was spent before its first call: the replay cannot tell that
    # from a slower machine's verdict, refuses the call as well, and the peer only loses.
    claimed = CalculatorWithShortCalls().episode("train", 0)
    claimed.tool_budget.adopt_exhaustion()
    answer = claimed.problem.answer
    rollout = generate(claimed, [python_call("12 * 34"), f"<answer>{answer}</answer>"])
    assert tool_messages(claimed) == [REFUSAL]
    replayed = replay_episode(CalculatorWithShortCalls().episode("train", 0), TOKENIZER, rollout)
    assert replayed.episode.messages() == claimed.messages()
    assert replayed.episode.tool_budget.calls_run == 0  # type: ignore[attr-defined]
