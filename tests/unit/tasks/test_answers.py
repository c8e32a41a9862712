"""The dataset task's answer checkers (tasks/answers.py) and their child process
(tasks/checker_process.py): each checker on constructed completions, bounded input, and checks
that hang, raise or come from threads other than the main one."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from decentrl.tasks.answers import (
    ANSWER_WINDOW_CHARS,
    ExactChecker,
    NumericChecker,
    ProcessChecker,
    make_checker,
    marked_answer,
)

VERIFIERS = '''
import time

def verify(completion, answer):
    return completion.strip() == answer

def half(completion, answer):
    return 0.5

def too_much(completion, answer):
    return 2.0

def broken(completion, answer):
    raise RuntimeError("the verifier broke")

def slow(completion, answer):
    if completion == "hang":
        while True:
            time.sleep(0.1)
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def verifiers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of verifiers on the import path, as a run owner's would be: its name."""
    (tmp_path / "my_verifiers.py").write_text(VERIFIERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_verifiers"
    sys.modules.pop("my_verifiers", None)


@pytest.fixture(scope="module")
def math_checker() -> Iterator[ProcessChecker]:
    checker = make_checker("math")
    assert isinstance(checker, ProcessChecker)
    yield checker
    checker.close()


# --- extraction ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("completion", "marked"), [
    ("So <answer> 42 </answer>.", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    (r"thus \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{3} and \boxed{4", "3"),  # the last box never closes: the one before it counts
    ("just 42", None),
])
def test_marked_answer_is_the_last_tagged_or_boxed_text(completion: str,
                                                        marked: str | None) -> None:
    assert marked_answer(completion) == marked


def test_checkers_read_only_the_completions_tail() -> None:
    padding = "x " * ANSWER_WINDOW_CHARS
    assert NumericChecker().score("<answer>7</answer>" + padding, "7") == 0.0
    assert NumericChecker().score(padding + "<answer>7</answer>", "7") == 1.0


# --- exact ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("completion", "answer", "score"), [
    ("Paris", "Paris", 1.0),
    ("  paris.  ", "Paris", 1.0),
    ("The capital is <answer>New  York</answer>", "new york", 1.0),
    ("Paris, France", "Paris", 0.0),
    ("", "Paris", 0.0),
])
def test_exact_compares_up_to_case_spacing_and_a_final_period(completion: str, answer: str,
                                                              score: float) -> None:
    assert ExactChecker().score(completion, answer) == score


# --- numeric -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("completion", "answer", "tolerance", "score"), [
    ("The answer is 1,234.", "1234", 0.0, 1.0),
    ("85.0", "85", 0.0, 1.0),
    ("-3.5 degrees", "-3.5", 0.0, 1.0),
    ("48-37 = 11", "11", 0.0, 1.0),
    ("1.05", "1", 0.05, 1.0),  # exactly at the tolerance: in (Fraction, not floats)
    ("1.0500001", "1", 0.05, 0.0),
    ("0.95", "1", 0.05, 1.0),
    ("<answer>12</answer> though 13 is close", "12", 0.0, 1.0),
    ("no number here", "3", 0.0, 0.0),
])
def test_numeric_reads_the_last_number_within_the_tolerance(completion: str, answer: str,
                                                            tolerance: float,
                                                            score: float) -> None:
    assert NumericChecker(tolerance).score(completion, answer) == score


def test_numeric_refuses_references_and_tolerances_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="not a number"):
        NumericChecker().check_reference("3/4")
    for tolerance in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="tolerance"):
            NumericChecker(tolerance)


# --- math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("completion", "answer", "score"), [
    ("0.5", r"\frac{1}{2}", 1.0),
    (r"so the answer is $\frac{1}{2}$", "0.5", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    ("$1+x$", "x+1", 1.0),
    ("The answer is 42.", "42", 1.0),
    (r"\boxed{41}", "42", 0.0),
    ("no answer", "42", 0.0),
])
def test_math_checks_equivalence_with_math_verify(math_checker: ProcessChecker, completion: str,
                                                  answer: str, score: float) -> None:
    assert math_checker.score(completion, answer) == score


def test_math_scores_off_the_main_thread(math_checker: ProcessChecker) -> None:
    # math-verify's own timeouts use SIGALRM, which raises ValueError outside the main thread;
    # the coordinator scores on its loop's and evaluation threads.
    scores: list[float] = []
    threads = [threading.Thread(target=lambda: scores.append(math_checker.score(r"\boxed{7}", "7")))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert scores == [1.0] * 4


def test_an_adversarial_math_completion_scores_0_in_bounded_time(
        math_checker: ProcessChecker) -> None:
    started = time.monotonic()
    assert math_checker.score(r"\boxed{9^{9^{9^{9}}}}", "1") == 0.0
    huge = r"\boxed{" + "(1+" * 5000 + "1" + ")" * 5000 + "}"
    assert math_checker.score(huge, "1") == 0.0
    assert time.monotonic() - started < 30
    assert math_checker.score(r"\boxed{7}", "7") == 1.0  # and the checker still works


def test_a_check_past_its_timeout_kills_the_child_and_the_next_starts_afresh(
        verifiers: str, caplog: pytest.LogCaptureFixture) -> None:
    checker = make_checker(f"{verifiers}:slow", timeout_s=1.0)
    assert isinstance(checker, ProcessChecker)
    try:
        assert checker.score("fine", "x") == 1.0
        first = checker.process._process
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert checker.score("hang", "x") == 0.0
        assert time.monotonic() - started < 10
        assert "no answer within 1.0 s" in caplog.text
        assert first is not None and first.poll() is not None  # killed and reaped
        assert checker.score("fine", "x") == 1.0
    finally:
        checker.close()


# --- a user's verifier ---------------------------------------------------------------------------


def test_a_users_verifier_scores_in_the_child(verifiers: str) -> None:
    exact, half = make_checker(f"{verifiers}:verify"), make_checker(f"{verifiers}:half")
    assert isinstance(exact, ProcessChecker) and isinstance(half, ProcessChecker)
    try:
        assert exact.score(" 12 ", "12") == 1.0
        assert exact.score("13", "12") == 0.0
        assert half.score("anything", "12") == 0.5  # partial credit
    finally:
        exact.close()
        half.close()


@pytest.mark.parametrize("function", ["broken", "too_much"])
def test_a_verifier_that_fails_gives_0_and_one_warning(
        verifiers: str, function: str, caplog: pytest.LogCaptureFixture) -> None:
    checker = make_checker(f"{verifiers}:{function}")
    assert isinstance(checker, ProcessChecker)
    try:
        with caplog.at_level(logging.WARNING, logger="decentrl.tasks.answers"):
            assert [checker.score("12", "12") for _ in range(3)] == [0.0] * 3
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert ("the verifier broke" if function == "broken" else "returned 2.0") \
            in warnings[0].getMessage()
        assert checker.failures == 3
    finally:
        checker.close()


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "message"), [
    ("fuzzy", "unknown checker 'fuzzy'; checkers: exact, numeric, math"),
    ("no_such_module_here:verify", "cannot import module 'no_such_module_here'"),
    (":verify", "must be one of"),
])
def test_unknown_or_unimportable_checkers_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_checker(spec)


def test_a_module_without_the_function_is_refused(verifiers: str) -> None:
    for name in ("missing", "NOT_A_FUNCTION"):
        with pytest.raises(ValueError, match=f"has no function '{name}'"):
            make_checker(f"{verifiers}:{name}")


def test_checker_options_are_checked() -> None:
    with pytest.raises(ValueError, match="tolerance is an option of the numeric checker"):
        make_checker("exact", tolerance=0.1)
    with pytest.raises(ValueError, match="check_timeout_s"):
        make_checker("math", timeout_s=0)
