"""Evaluation results per difficulty level (`EvalResult.levels`): the levels partition the
problems and add up to the whole, each with its interval; an environment's episodes, and how far
along their chain they got, are tallied per level; older files without levels still load; the
demo, the report and the suite's table show them."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from helpers import build
from rich.console import Console

from decentrl.demo import levels_table
from decentrl.envs import Environment, make_task_or_environment
from decentrl.envs.base import Message
from decentrl.evaluate.divergence import GeneralResult
from decentrl.evaluate.runner import (
    EpisodeStats,
    EvalResult,
    LevelStats,
    TrainingShape,
    chain_step_counts,
    evaluate,
    level_order,
)
from decentrl.evaluate.stats import Accuracy
from decentrl.evaluate.suite import (
    Family,
    FamilyResult,
    SuiteResult,
    chain_steps_text,
    eval_result_from_json,
    level_rows,
    pass1_change,
    suite_table_markdown,
)
from decentrl.model.loading import LoadedModel, load_model
from decentrl.observe.report import held_out_table
from decentrl.observe.report_data import read_evaluation
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.sampling import SamplingConfig
from decentrl.tasks.arithmetic import SumsTask
from decentrl.tasks.base import Problem, Reward, difficulty_of

# One-step and two-step stories: two levels.
CALCULATOR = {"stories": ["purchase", "shopping"], "prefill_first_call": True, "max_turns": 3}


class ParitySums(SumsTask):
    """Sums solved when the completion's length is even: about half the rows, whatever the tiny
    model writes, so that the levels' successes have something to add up."""

    def reward(self, problem: Problem, completion: str) -> Reward:
        return Reward(correct=float(len(completion) % 2 == 0), format=0.0)


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


def assert_levels_partition(result: EvalResult, task: ParitySums | Environment,
                            count: int) -> None:
    by_level = Counter(difficulty_of(task.problem("heldout", index)) for index in range(count))
    assert {name: level.problems for name, level in result.levels.items()} == by_level
    assert list(result.levels) == sorted(by_level, key=level_order)
    for level in result.levels.values():
        for accuracy in (level.pass1, level.greedy_pass1):
            if accuracy is not None:
                assert 0.0 <= accuracy.low <= accuracy.mean <= accuracy.high <= 1.0
                assert accuracy.n == level.problems


def test_greedy_levels_add_up_to_the_whole_with_wilson_intervals(sharp: LoadedModel) -> None:
    task, count = ParitySums(min_digits=1, max_digits=2), 12
    result = evaluate(LocalChain(build(sharp, 2)), task, sharp.tokenizer, count, 6, 4)
    assert len(result.levels) > 1  # digit counts and carries: several levels among 12 sums
    assert_levels_partition(result, task, count)
    solved = {name: round(level.pass1.mean * level.problems)
              for name, level in result.levels.items()}
    assert 0 < sum(solved.values()) == round(result.pass1.mean * count) < count
    for name, level in result.levels.items():
        assert level.pass1 == Accuracy.from_counts(solved[name], level.problems)
        assert level.greedy_pass1 is None and level.episodes is None
        assert level.chain_steps is None  # a task has no chain


def test_sampled_levels_average_like_pass1_and_carry_greedy_rows(sharp: LoadedModel) -> None:
    """A training-shaped evaluation: a level's pass@1 is the mean of its problems' sampled
    success, with the normal interval, and its greedy pass@1 counts its greedy rows."""
    task, count = ParitySums(min_digits=1, max_digits=2), 8
    shape = TrainingShape(3, SamplingConfig(temperature=1.0), problems_per_session=2,
                          greedy=True)
    result = evaluate(LocalChain(build(sharp, 2)), task, sharp.tokenizer, count, 6, 4,
                      shape=shape)
    assert_levels_partition(result, task, count)
    assert sum(level.pass1.mean * level.problems for level in result.levels.values()) \
        == pytest.approx(result.pass1.mean * count)
    assert result.greedy_pass1 is not None
    greedy = [level.greedy_pass1 for level in result.levels.values()]
    assert sum(round(g.mean * g.n) for g in greedy if g is not None) \
        == round(result.greedy_pass1.mean * count)
    assert all(g is not None for g in greedy)


def test_chain_progress_is_tallied_per_level_over_the_pass1_episodes(
        tiny_model: LoadedModel) -> None:
    """The chain-progress callable sees each finished episode's problem and conversation; its
    counts land in the episode's level (a None, a problem without a chain, is left out), and the
    levels' episode statistics add up to the whole's."""
    environment = make_task_or_environment("agentic-calculator", CALCULATOR)
    assert isinstance(environment, Environment)
    seen: dict[str, list[int | None]] = defaultdict(list)

    def progress(problem: Problem, messages: list[Message]) -> int | None:
        steps = None if problem.index % 4 == 3 else sum(m["role"] == "tool" for m in messages)
        seen[difficulty_of(problem)].append(steps)
        return steps

    # The nearly uniform tiny model sampled at T=1: turns end now and then, with tool calls.
    count, group = 8, 4
    shape = TrainingShape(group, SamplingConfig(temperature=1.0), problems_per_session=2)
    result = evaluate(LocalChain(build(tiny_model, 2)), environment, tiny_model.tokenizer, count,
                      64, 4, shape=shape, chain_progress=progress)
    assert_levels_partition(result, environment, count)
    assert len(result.levels) > 1 and set(result.levels) == set(seen)
    for name, level in result.levels.items():
        reached = [steps for steps in seen[name] if steps is not None]
        counts = level.chain_steps
        if not reached:
            assert counts is None
            continue
        assert counts is not None and sum(counts.values()) == len(reached)
        assert {int(steps): n for steps, n in counts.items() if n} == Counter(reached)
        assert list(map(int, counts)) == list(range(max(reached) + 1))
    assert any(len(set(steps)) > 1 for steps in seen.values())
    assert result.episodes is not None
    levels = [level.episodes for level in result.levels.values()]
    assert all(isinstance(stats, EpisodeStats) for stats in levels)
    assert sum(s.played or 0 for s in levels if s) == result.episodes.played == count * group
    assert result.episodes.mean_tool_calls > 0
    assert sum(s.mean_tool_calls * (s.played or 0) for s in levels if s) \
        == pytest.approx(result.episodes.mean_tool_calls * count * group)
    assert sum(s.cut_by_budget for s in levels if s) == result.episodes.cut_by_budget


def test_chain_step_counts_fill_the_steps_between_and_read_as_shares() -> None:
    assert chain_step_counts([None, None]) is None
    counts = chain_step_counts([2, None, 0, 2, 0, 3])
    assert counts == {"0": 2, "1": 0, "2": 2, "3": 1}
    assert chain_steps_text(counts) == "step 1 60%, step 2 60%, step 3 20% (of 5)"
    assert chain_steps_text({"0": 4}) == "no step (of 4)"


def test_levels_sort_their_numbers_as_numbers() -> None:
    names = ["10 numbers", "3 numbers", "2 steps", "1 step", "purchase", "1+2 digits, 1 carry",
             "1+1 digits, 0 carries", "~8 words"]
    assert sorted(names, key=level_order) == [
        "1 step", "1+1 digits, 0 carries", "1+2 digits, 1 carry", "2 steps", "3 numbers",
        "10 numbers", "purchase", "~8 words"]


def result_with_levels(pass1: Accuracy, levels: dict[str, LevelStats]) -> EvalResult:
    return EvalResult(task="agentic-calculator", split="heldout", problems=40, pass1=pass1,
                      pass_k=None, k=1, mean_completion_tokens=30.0, samples=[],
                      episodes=EpisodeStats(2.0, 1.5, 0.1, 0, 40), levels=levels)


ONE_STEP, TWO_STEPS = Accuracy.from_counts(15, 20), Accuracy.from_counts(4, 20)
AFTER = result_with_levels(Accuracy.from_counts(19, 40), {
    "1 step": LevelStats(20, ONE_STEP, episodes=EpisodeStats(2.0, 1.0, 0.0, 0, 20),
                         chain_steps={"0": 2, "1": 18}),
    "2 steps": LevelStats(20, TWO_STEPS, episodes=EpisodeStats(2.5, 2.0, 0.25, 1, 20),
                          chain_steps={"0": 8, "1": 10, "2": 2})})


def test_old_files_without_levels_still_load_and_new_ones_round_trip(tmp_path: Path) -> None:
    data = AFTER.to_json()
    path = tmp_path / "eval_after.json"
    path.write_text(json.dumps(data))
    assert read_evaluation(path) == AFTER
    assert eval_result_from_json(json.loads(path.read_text())) == AFTER
    del data["levels"]
    path.write_text(json.dumps(data))
    older = read_evaluation(path)
    assert older is not None and older.levels == {}
    assert eval_result_from_json(data).levels == {}
    assert level_rows(older, older) == []


def test_the_tables_show_each_level_with_its_change_and_chain_steps() -> None:
    before = result_with_levels(Accuracy.from_counts(12, 40), {
        "1 step": LevelStats(20, Accuracy.from_counts(12, 20), chain_steps={"0": 5, "1": 15}),
        "2 steps": LevelStats(20, Accuracy.from_counts(0, 20), chain_steps={"0": 20})})
    rows = level_rows(before, AFTER)
    one_step_change = pass1_change(ONE_STEP, Accuracy.from_counts(12, 20))
    assert rows[0][0] == "1 step (20 problems)" and rows[0][1] == "episode success (greedy)"
    assert rows[0][3] == ONE_STEP.as_percent()
    assert rows[0][4].startswith(f"{100 * one_step_change.mean:+.1f} pts")
    assert ["", "turns · tool calls · invalid-call rate", "-", "2.50 · 2.00 · 25.0%",
            "-"] in rows
    assert ["", "episodes that reached chain step", "no step (of 20)",
            "step 1 60%, step 2 10% (of 20)", "-"] in rows
    report = held_out_table(before, AFTER)
    assert "| 2 steps (20 problems) | episode success (greedy) | 0.0% [" in report
    console = Console(width=200, record=True)
    table = levels_table(before, AFTER)
    assert table is not None
    console.print(table)
    assert "step 1 60%, step 2 10% (of 20)" in console.export_text()
    assert levels_table(None, result_with_levels(ONE_STEP, {})) is None
    family = Family("agentic-calculator", problems=40)
    suite = SuiteResult(model="m", base="b", pass_k=1, seed=0,
                        families=[FamilyResult(family, AFTER, before, None, None)],
                        general=GeneralResult(4, 100, 13.0, None, None), seconds=1.0)
    assert ("|  | 2 steps (20 problems): episodes that reached chain step | no step (of 20) | "
            "step 1 60%, step 2 10% (of 20) | - |") in suite_table_markdown(suite)
