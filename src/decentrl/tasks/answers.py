"""Answer checkers of the dataset task: how much of a reference answer a completion got right.

`make_checker(spec)` takes the task's `checker` option:
- "exact": the marked answer (below), else the whole completion, equals the reference up to case,
  surrounding whitespace, runs of whitespace and one final period ("Paris." is "paris").
- "numeric": the last number of the marked answer, else of the completion ("1,234", "-3.5",
  "85.0"), is within `tolerance` of the reference (0 unless set), computed exactly on the decimals
  as written (fractions.Fraction), so 1.05 is within 0.05 of 1. Every reference must be a number.
- "math": math-verify's extraction and equivalence ("\\frac{1}{2}" is 0.5, "$1+x$" is x+1), on
  the text of the last <answer></answer> pair if there is one.
- "module:function": the run owner's verifier, `function(completion, answer)` returning a bool or a
  number in [0, 1] (partial credit). It must be deterministic: the coordinator recomputes rewards.
The marked answer is the text inside the last <answer></answer> pair, else inside the last
\\boxed{...}.

Completions come from untrusted peers, so every checker reads only a completion's last
ANSWER_WINDOW_CHARS characters (an answer ends its completion), and the two that can hang on
adversarial text, math-verify (sympy) and the user's function, run in a child process under a
watchdog (tasks/checker_process.py). A failed check (the verifier raised or returned something
else than a score, the child timed out or died) scores 0, not the run's end: the first failure of
a checker is logged as a warning, the later ones at debug level, since a peer can cause them at
will.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Protocol

from decentrl.tasks.arithmetic import NUMBER_RE, last_number
from decentrl.tasks.base import is_real
from decentrl.tasks.checker_process import CheckerProcess

log = logging.getLogger(__name__)

EXACT, NUMERIC, MATH = "exact", "numeric", "math"
BUILT_IN_CHECKERS = (EXACT, NUMERIC, MATH)
# A completion's tail that the checkers read: room for a worked final step and its answer.
ANSWER_WINDOW_CHARS = 2000
# An honest check takes milliseconds; a timeout far above that keeps rewards reproducible.
DEFAULT_CHECK_TIMEOUT_S = 10.0
# The math checker's child: math-verify and sympy need about 200 MB of address space.
MATH_MEMORY_MB = 2048
# A failure's message in the log is the verifier's text, which may quote the completion.
SHOWN_ERROR_CHARS = 300

ANSWER_TAGS_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = "\\boxed{"


def answer_window(completion: str) -> str:
    return completion[-ANSWER_WINDOW_CHARS:]


def boxed_content(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces close, or None."""
    start = text.rfind(BOXED)
    while start != -1:
        depth, position = 1, start + len(BOXED)
        while position < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            position += 1
        if depth == 0:
            return text[start + len(BOXED):position - 1]
        start = text.rfind(BOXED, 0, start)
    return None


def tagged_answer(completion: str) -> str | None:
    """The text of the last <answer></answer> pair in the window, or None."""
    tagged = ANSWER_TAGS_RE.findall(answer_window(completion))
    return tagged[-1] if tagged else None


def marked_answer(completion: str) -> str | None:
    """The text of the last <answer></answer> pair, else of the last \\boxed{...}, stripped."""
    marked = tagged_answer(completion)
    if marked is None:
        marked = boxed_content(answer_window(completion))
    return None if marked is None else marked.strip()


def math_text(completion: str) -> str:
    """What math-verify reads: the tagged answer if there is one (it knows \\boxed{...} itself,
    not answer tags), else the window."""
    tagged = tagged_answer(completion)
    return tagged if tagged is not None else answer_window(completion)


def normalize_text(text: str) -> str:
    return " ".join(text.split()).removesuffix(".").strip().casefold()


class AnswerChecker(Protocol):
    spec: str

    def check_reference(self, answer: str) -> None:
        """Raise ValueError if `answer` cannot be a reference for this checker."""
        ...

    def extract(self, completion: str) -> str | None:
        """The answer the checker reads in `completion`, for display; None if it finds none."""
        ...

    def score(self, completion: str, answer: str) -> float:
        """In [0, 1]: 1 for a right answer."""
        ...


class ExactChecker:
    spec = EXACT

    def check_reference(self, answer: str) -> None:
        if not normalize_text(answer):
            raise ValueError("the reference is empty once normalized")

    def extract(self, completion: str) -> str | None:
        marked = marked_answer(completion)
        text = marked if marked is not None else answer_window(completion).strip()
        return text or None

    def score(self, completion: str, answer: str) -> float:
        extracted = self.extract(completion)
        return float(extracted is not None and normalize_text(extracted) == normalize_text(answer))


class NumericChecker:
    spec = NUMERIC

    def __init__(self, tolerance: float = 0.0) -> None:
        if not (is_real(tolerance) and math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        # From its decimal text: Fraction(0.05) would be the binary float, a hair above 1/20.
        self.tolerance = Fraction(str(tolerance))

    def check_reference(self, answer: str) -> None:
        if NUMBER_RE.fullmatch(answer.strip()) is None:
            raise ValueError(f"{answer!r} is not a number (an integer or a decimal, such as "
                             "-12, 1,234 or 0.75)")

    def extract(self, completion: str) -> str | None:
        marked = marked_answer(completion)
        return last_number(marked if marked is not None else answer_window(completion))

    def score(self, completion: str, answer: str) -> float:
        extracted = self.extract(completion)
        reference = last_number(answer.strip())
        if extracted is None or reference is None:
            return 0.0
        return float(abs(Fraction(extracted) - Fraction(reference)) <= self.tolerance)


class ProcessChecker:
    """math-verify or a user's function, run in a child process (tasks/checker_process.py)."""

    def __init__(self, spec: str, timeout_s: float, memory_mb: int | None,
                 text_of: Callable[[str], str] = answer_window) -> None:
        self.spec = spec
        self.text_of = text_of  # the part of a completion the child reads
        self.process = CheckerProcess(spec, timeout_s, memory_mb)
        self.failures = 0

    def check_reference(self, answer: str) -> None:
        pass  # math-verify reads most anything; a user's verifier knows its own references

    def extract(self, completion: str) -> str | None:
        return marked_answer(completion)

    def score(self, completion: str, answer: str) -> float:
        value, error = self.process.check(self.text_of(completion), answer)
        if error is not None:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            log.log(level, "answer checker %s failed, reward 0 (failure %d; later ones are logged "
                    "at debug level): %r", self.spec, self.failures, error[:SHOWN_ERROR_CHARS])
        return value

    def close(self) -> None:
        self.process.close()


def check_importable(spec: str) -> None:
    """Raise ValueError unless "module:function" names a callable the coordinator can import."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"checker {spec!r} must be one of {', '.join(BUILT_IN_CHECKERS)} or "
                         "module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # whatever importing the user's module raises
        raise ValueError(f"checker {spec!r}: cannot import module {module_name!r} ({error}); it "
                         "must be importable where the coordinator runs (PYTHONPATH)") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"checker {spec!r}: module {module_name!r} has no function "
                         f"{function_name!r}")


def make_checker(spec: str, tolerance: float | None = None,
                 timeout_s: float = DEFAULT_CHECK_TIMEOUT_S) -> AnswerChecker:
    """The checker `spec` names (module docstring); `tolerance` is the numeric checker's."""
    if tolerance is not None and spec != NUMERIC:
        raise ValueError(f"tolerance is an option of the {NUMERIC} checker, not of {spec!r}")
    if not (is_real(timeout_s) and 0 < timeout_s <= 3600):
        raise ValueError(f"check_timeout_s must be in (0, 3600], got {timeout_s!r}")
    if spec == EXACT:
        return ExactChecker()
    if spec == NUMERIC:
        return NumericChecker(0.0 if tolerance is None else tolerance)
    if spec == MATH:
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError("the math checker needs the math-verify package "
                             "(pip install math-verify)")
        return ProcessChecker(MATH, timeout_s, MATH_MEMORY_MB, math_text)
    if ":" not in spec:
        raise ValueError(f"unknown checker {spec!r}; checkers: {', '.join(BUILT_IN_CHECKERS)}, "
                         "or module:function for a verifier of your own")
    check_importable(spec)
    # No memory limit: the verifier is the run owner's code and may load what it needs.
    return ProcessChecker(spec, timeout_s, None)
