"""The built-in "sums" task: add a few non-negative integers. No dependencies, instant to generate.

The split key is the sorted operands ("37+48"), so 37 + 48 and 48 + 37 share a split and
memorising one order cannot leak into the other. The key does not depend on the digit options
either: a task trained with max_digits=2 and one evaluated with min_digits=2, max_digits=2 agree
on which pairs are held out.
"""

from __future__ import annotations

import random
import re

from decentrl.tasks.base import (
    DIFFICULTY,
    Problem,
    Reward,
    SplitDrawn,
    check_format_weight,
    check_heldout_fraction,
)

MAX_DIGITS = 9
MIN_TERMS, MAX_TERMS = 2, 6

# An integer, optionally negative, with or without thousands separators ("1,234"). The minus only
# counts when it cannot be a binary operator, so "48-37" reads as 48 and 37, not 48 and -37.
# A match never starts or stops inside a run of digits and commas: in "1,2345" only 2345 counts.
INTEGER = r"(?:(?<![\w)])-)?(?<!\d)(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|,\d)"
# A number as it appears in prose: the integer plus an optional decimal part, read so that
# "85.0" is 85 and not 0.
NUMBER_RE = re.compile(rf"({INTEGER})(?:\.(\d+))?")
# The completions that earn the format bonus: "85", or "37 + 48 = 85", optionally with a period.
WELL_FORMED_RE = re.compile(rf"(?:{INTEGER}(?:\s*[-+*/]\s*{INTEGER})*\s*=\s*)?{INTEGER}\.?")


def check_int_option(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


def last_number(text: str) -> str | None:
    """The last number in the text, canonical: "1,234." -> "1234", "85.0" -> "85".

    A number with a non-zero decimal part comes back as written ("3.5") and so never matches
    an integer answer.
    """
    matches = NUMBER_RE.findall(text)
    if not matches:
        return None
    integer_part, decimal_part = matches[-1]
    integer_part = integer_part.replace(",", "")
    if decimal_part.strip("0"):
        return f"{integer_part}.{decimal_part}"
    return str(int(integer_part))


def sums_difficulty(operands: list[int]) -> str:
    """The operands' digit counts, smallest first, and the columns that carry ("1+2 digits,
    1 carry"): within one digit range the base model solves sums without carries several times
    as often as sums with them (bench/curriculum.py)."""
    digits = "+".join(str(len(str(n))) for n in sorted(operands))
    carries, carry, rest = 0, 0, list(operands)
    while any(rest) or carry:
        carry = (sum(n % 10 for n in rest) + carry) // 10
        carries += carry > 0
        rest = [n // 10 for n in rest]
    return f"{digits} digits, {carries} carr{'y' if carries == 1 else 'ies'}"


class SumsTask(SplitDrawn):
    name = "sums"

    def __init__(
        self,
        min_digits: int = 1,
        max_digits: int = 2,
        terms: int = 2,
        heldout_fraction: float = 0.1,
        format_weight: float = 0.1,
    ) -> None:
        check_int_option("min_digits", min_digits, 1, MAX_DIGITS)
        check_int_option("max_digits", max_digits, min_digits, MAX_DIGITS)
        check_int_option("terms", terms, MIN_TERMS, MAX_TERMS)
        check_heldout_fraction(heldout_fraction)
        check_format_weight(format_weight)
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.terms = terms
        self.heldout_fraction = heldout_fraction
        self.format_weight = format_weight

    def _candidate(self, index: int, seed: int) -> Problem:
        rng = random.Random(seed)
        operands = []
        for _ in range(self.terms):
            digits = rng.randint(self.min_digits, self.max_digits)
            smallest = 0 if digits == 1 else 10 ** (digits - 1)
            operands.append(rng.randint(smallest, 10**digits - 1))
        return Problem(
            task=self.name,
            index=index,
            question=f"What is {' + '.join(map(str, operands))}? Answer with just the number.",
            answer=str(sum(operands)),
            key="+".join(map(str, sorted(operands))),
            metadata={"operands": operands, DIFFICULTY: sums_difficulty(operands)},
        )

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.question}]

    def extract_answer(self, completion: str) -> str | None:
        return last_number(completion)

    def reward(self, problem: Problem, completion: str) -> Reward:
        extracted = self.extract_answer(completion)
        # Both sides are canonical integer strings, so string equality is integer equality.
        correct = extracted == problem.answer
        well_formed = WELL_FORMED_RE.fullmatch(completion.strip()) is not None
        return Reward(
            correct=1.0 if correct else 0.0,
            format=self.format_weight if well_formed else 0.0,
        )
