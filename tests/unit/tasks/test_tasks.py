from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from typing import Any

import pytest

from decentrl.tasks import Problem, Reward, make_task, problems, render_prompt, split_of

RG_TASKS = ("rg:chain_sum", "rg:basic_arithmetic", "rg:countdown", "rg:gsm_symbolic")


def keys(task_problems: list[Problem]) -> set[str]:
    return {problem.key for problem in task_problems}


# --- split ---------------------------------------------------------------------------------------


def test_split_of_is_a_fixed_hash() -> None:
    # The same key always lands in the same split; a bigger fraction only adds held-out keys.
    all_keys = [f"{a}+{b}" for a in range(100) for b in range(a, 100)]
    small = {key for key in all_keys if split_of(key, 0.1) == "heldout"}
    large = {key for key in all_keys if split_of(key, 0.3) == "heldout"}
    assert small < large
    assert 0.08 < len(small) / len(all_keys) < 0.12
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_of("1+2", 1.0)


def test_two_digit_pairs_leave_a_large_heldout_space() -> None:
    # 90 * 91 / 2 = 4095 unordered pairs of 2-digit numbers; about 10% (~410 keys, ~820 ordered
    # pairs) must be held out, plenty to evaluate on.
    pair_keys = [f"{a}+{b}" for a in range(10, 100) for b in range(a, 100)]
    assert len(pair_keys) == 4095
    heldout = [key for key in pair_keys if split_of(key, 0.1) == "heldout"]
    assert 330 < len(heldout) < 490


# --- sums ----------------------------------------------------------------------------------------


def test_sums_problems_are_pinned() -> None:
    # Problems must never change: runs, checkpoints and evaluations refer to them by index. These
    # values were recorded once; a change of seeding, hashing or generation order breaks them.
    task = make_task("sums")
    assert [problem.question for problem in problems(task, "train", 3)] == [
        "What is 4 + 3? Answer with just the number.",
        "What is 6 + 7? Answer with just the number.",
        "What is 54 + 7? Answer with just the number.",
    ]
    assert [problem.key for problem in problems(task, "heldout", 3)] == ["5+6", "62+83", "8+49"]


def test_sums_is_deterministic() -> None:
    first = problems(make_task("sums"), "train", 50) + problems(make_task("sums"), "heldout", 20)
    again = problems(make_task("sums"), "train", 50) + problems(make_task("sums"), "heldout", 20)
    assert first == again
    assert len({problem.question for problem in first}) > 30  # not one problem repeated


def test_sums_problem_contents() -> None:
    task = make_task("sums", min_digits=2, max_digits=3, terms=3)
    for problem in problems(task, "train", 200):
        operands = problem.metadata["operands"]
        assert len(operands) == 3
        assert all(10 <= operand <= 999 for operand in operands)
        assert problem.answer == str(sum(operands))
        terms = " + ".join(map(str, operands))
        assert problem.question == f"What is {terms}? Answer with just the number."
        assert problem.key == "+".join(map(str, sorted(operands)))
        assert problem.task == "sums"
    assert problems(task, "train", 3, start=7) == [task.problem("train", i) for i in (7, 8, 9)]


def test_sums_splits_are_disjoint_and_commutative() -> None:
    task = make_task("sums")
    train = problems(task, "train", 3000)
    heldout = problems(task, "heldout", 400)
    assert all(split_of(problem.key, 0.1) == "train" for problem in train)
    assert all(split_of(problem.key, 0.1) == "heldout" for problem in heldout)
    assert keys(train).isdisjoint(keys(heldout))
    # A held-out 37 + 48 must not appear in training as 48 + 37.
    train_questions = {problem.question for problem in train}
    for problem in heldout:
        reversed_terms = " + ".join(map(str, reversed(problem.metadata["operands"])))
        assert f"What is {reversed_terms}? Answer with just the number." not in train_questions


def test_sums_split_agrees_across_digit_options() -> None:
    # Train on 1-2 digit operands, evaluate on 2-digit only: the held-out pairs must be the same.
    mixed = make_task("sums", min_digits=1, max_digits=2)
    two_digit = make_task("sums", min_digits=2, max_digits=2)
    mixed_train = keys(problems(mixed, "train", 3000))
    mixed_heldout = keys(problems(mixed, "heldout", 500))
    two_train = keys(problems(two_digit, "train", 3000))
    two_heldout = keys(problems(two_digit, "heldout", 500))
    assert mixed_train.isdisjoint(two_heldout)
    assert mixed_heldout.isdisjoint(two_train)
    # The check above is only meaningful if the two tasks share keys at all.
    assert len(mixed_train & two_train) > 100
    assert len(mixed_heldout & two_heldout) > 10


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("37 + 48 = 85", "85"),
        ("The answer is 1,234.", "1234"),
        ("no number", None),
        ("-5", "-5"),
        ("48-37", "37"),  # a minus between numbers is subtraction, not a sign
        ("x = -5", "-5"),
        ("85.0", "85"),  # not "0"
        ("3.5", "3.5"),
        ("1,2,3", "3"),  # a list, not thousands separators
        ("1,2345", "2345"),  # not 1,234 followed by a stray 5
        ("first 12 then 1,000,000", "1000000"),
    ],
)
def test_sums_extract_answer(completion: str, expected: str | None) -> None:
    assert make_task("sums").extract_answer(completion) == expected


def test_sums_reward() -> None:
    task = make_task("sums", format_weight=0.25)
    problem = dataclasses.replace(
        task.problem("train", 0),
        question="What is 37 + 48? Answer with just the number.",
        answer="85",
    )
    assert task.reward(problem, "85") == Reward(correct=1.0, format=0.25)
    assert task.reward(problem, " 37 + 48 = 85.\n") == Reward(correct=1.0, format=0.25)
    assert task.reward(problem, "The answer is 85") == Reward(correct=1.0, format=0.0)
    assert task.reward(problem, "84") == Reward(correct=0.0, format=0.25)
    assert task.reward(problem, "85.5") == Reward(correct=0.0, format=0.0)
    assert task.reward(problem, "I don't know") == Reward(correct=0.0, format=0.0)
    assert task.reward(problem, "85").total == pytest.approx(1.25)
    assert task.reward(problem, "85").solved
    assert not task.reward(problem, "84").solved


def test_sums_real_problem_rewards_its_own_answer() -> None:
    task = make_task("sums")
    for problem in problems(task, "heldout", 20):
        assert task.reward(problem, f"The sum is {problem.answer}.").correct == 1.0
        assert task.reward(problem, str(int(problem.answer) + 1)).correct == 0.0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "max_digits"),
        ({"max_digits": 10}, "max_digits"),
        ({"terms": 1}, "terms"),
        ({"terms": 7}, "terms"),
        ({"terms": "3"}, "terms"),
        ({"heldout_fraction": 0.0}, "heldout_fraction"),
        ({"heldout_fraction": 1.0}, "heldout_fraction"),
        ({"format_weight": -0.1}, "format_weight"),
        ({"digits": 2}, "digits"),  # not an option at all
    ],
)
def test_sums_option_errors_name_the_option(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make_task("sums", **options)


def test_unknown_task_lists_known_names() -> None:
    with pytest.raises(ValueError, match="sums.*rg:countdown"):
        make_task("multiplication")


def test_sums_problem_rejects_bad_split() -> None:
    task = make_task("sums")
    with pytest.raises(ValueError, match="test"):
        task.problem("test", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="-1"):
        task.problem("train", -1)


# --- reasoning-gym -------------------------------------------------------------------------------


def wrong_answer(task_name: str, problem: Problem) -> str:
    if task_name == "rg:countdown":
        return "1 + 1"  # does not use the given numbers
    # reference + 1 never contains the reference as a substring, which would earn partial credit.
    return str(Decimal(problem.answer) + 1)


@pytest.mark.parametrize("task_name", RG_TASKS)
def test_reasoning_gym_task(task_name: str) -> None:
    task = make_task(task_name)
    train = problems(task, "train", 30)
    heldout = problems(task, "heldout", 5)
    assert train == problems(make_task(task_name), "train", 30)  # deterministic across instances
    assert len({problem.question for problem in train}) > 20
    assert keys(train).isdisjoint(keys(heldout))
    assert all(split_of(problem.key, 0.1) == "heldout" for problem in heldout)

    for problem in train[:10] + heldout:
        assert problem.task == task_name
        json.dumps(problem.metadata)  # must stay serialisable
        reference = task.reward(problem, f"Some reasoning.\n<answer>{problem.answer}</answer>")
        assert reference == Reward(correct=1.0, format=0.1)
        wrong = task.reward(problem, f"<answer>{wrong_answer(task_name, problem)}</answer>")
        assert not wrong.solved
        assert wrong.correct < 0.1  # countdown and gsm_symbolic give 0.05 / 0.01 partial credit
        assert wrong.format == 0.1
        assert task.reward(problem, problem.answer) == Reward(correct=0.0, format=0.0)  # no tags

    messages = task.messages(train[0])
    assert [message["role"] for message in messages] == ["system", "user"]
    assert "<answer>" in messages[0]["content"]
    assert messages[1]["content"] == train[0].question


def test_reasoning_gym_exact_answers_score_zero_when_wrong() -> None:
    for task_name in ("rg:chain_sum", "rg:basic_arithmetic"):
        task = make_task(task_name)
        problem = task.problem("train", 0)
        wrong = f"<answer>{wrong_answer(task_name, problem)}</answer>"
        assert task.reward(problem, wrong).correct == 0.0


def test_reasoning_gym_rescores_a_problem_from_json() -> None:
    # A problem saved as JSON and scored by a fresh task (no cached entries) scores the same.
    problem = make_task("rg:countdown").problem("train", 3)
    loaded = Problem(**json.loads(json.dumps(dataclasses.asdict(problem))))
    fresh = make_task("rg:countdown")
    assert fresh.reward(loaded, f"<answer>{problem.answer}</answer>").correct == 1.0
    # The same seed under another config rebuilds another question, which is refused.
    other = make_task("rg:countdown", config={"min_numbers": 3, "max_numbers": 3})
    with pytest.raises(ValueError, match="config"):
        other.reward(loaded, f"<answer>{problem.answer}</answer>")


def test_reasoning_gym_config_passes_through() -> None:
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = make_task("rg:chain_sum", config=config)
    for problem in problems(task, "train", 10):
        assert len(problem.metadata["entry"]["metadata"]["expression"].split()) == 3  # "a + b"


@pytest.mark.parametrize(
    ("name", "options", "named"),
    [
        ("rg:no_such_dataset", {}, "no_such_dataset.*chain_sum"),
        ("rg:chain_sum", {"config": {"min_terms": 0}}, "chain_sum"),  # reasoning-gym assertion
        ("rg:chain_sum", {"config": {"bogus": 1}}, "bogus"),  # reasoning-gym TypeError
        ("rg:chain_sum", {"config": {"seed": 1}}, "seed"),
        ("rg:chain_sum", {"format_weight": -1.0}, "format_weight"),
        ("rg:chain_sum", {"min_terms": 2}, "min_terms"),  # dataset options go inside config
    ],
)
def test_reasoning_gym_errors(name: str, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make_task(name, **options)


# --- render_prompt -------------------------------------------------------------------------------


class StubTokenizer:
    """Test double for a chat tokenizer: records the call, returns canned token ids."""

    def __init__(self, output: Any) -> None:
        self.output = output
        self.calls: list[tuple[list[dict[str, str]], dict[str, Any]]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        self.calls.append((messages, kwargs))
        return self.output


@pytest.mark.parametrize("output", [{"input_ids": [5, 6, 7]}, [5, 6, 7]])
def test_render_prompt_accepts_dict_and_list(output: Any) -> None:
    task = make_task("sums")
    problem = task.problem("train", 0)
    tokenizer = StubTokenizer(output)
    assert render_prompt(task, problem, tokenizer) == [5, 6, 7]
    messages, kwargs = tokenizer.calls[0]
    assert messages == [{"role": "user", "content": problem.question}]
    assert kwargs == {"add_generation_prompt": True, "tokenize": True}


def test_render_prompt_rejects_a_batch() -> None:
    task = make_task("sums")
    with pytest.raises(TypeError, match="not all ints"):
        render_prompt(task, task.problem("train", 0), StubTokenizer({"input_ids": [[5, 6, 7]]}))
