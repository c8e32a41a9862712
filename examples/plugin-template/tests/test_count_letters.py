"""The count-letters task: deterministic problems, a split by key, rewards from completions."""

from __future__ import annotations

import pytest
from decentrl_plugin_example.letters import CountLettersTask

from decentrl.tasks.base import split_of


def test_problems_are_deterministic_and_answered_by_counting() -> None:
    task = CountLettersTask()
    for index in range(50):
        problem = task.problem("train", index)
        assert problem == CountLettersTask().problem("train", index)
        word, letter = problem.metadata["word"], problem.metadata["letter"]
        assert problem.answer == str(word.count(letter)) and problem.key == f"{word}:{letter}"
        assert problem.task == "count-letters"


def test_the_splits_are_disjoint_by_the_key_hash() -> None:
    task = CountLettersTask(heldout_fraction=0.2)
    train = {task.problem("train", index).key for index in range(100)}
    heldout = {task.problem("heldout", index).key for index in range(100)}
    assert not train & heldout
    assert all(split_of(key, 0.2) == "heldout" for key in heldout)


def test_rewards_read_the_last_number() -> None:
    task = CountLettersTask(format_weight=0.1)
    problem = next(p for p in (task.problem("train", i) for i in range(50)) if p.answer == "3")
    assert task.reward(problem, "3").total == pytest.approx(1.1)
    assert task.reward(problem, "I count 2, no, 3 of them.").total == 1.0
    assert task.reward(problem, "4").total == pytest.approx(0.1)
    assert task.reward(problem, "none").total == 0.0


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="absent_letters"):
        CountLettersTask(absent_letters=1.5)
    with pytest.raises(ValueError, match="heldout_fraction"):
        CountLettersTask(heldout_fraction=0.0)
