"""The task protocol: problems, chat messages, answer extraction, rewards, train/held-out split.

The split is a property of the problem, not of the draw. `split_of` hashes a problem's canonical
`key` with SHA-256, so a problem is held out or not forever, on every machine, whatever options the
task was built with. `problem(split, index)` draws candidates from a stream seeded by
(task name, split, index, attempt) and keeps the first whose key falls in the requested split; the
two splits are therefore disjoint by construction, not by bookkeeping.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

Split = Literal["train", "heldout"]
SPLITS: tuple[str, ...] = get_args(Split)

# Missing the requested split this many times in a row has probability about exp(-50) when keys
# really do fall in it with the configured fraction; reaching it means the task's problem space
# holds (almost) no key of that split.
SPLIT_MISS_BUDGET = 50
# The metadata entry in which a task names a problem's difficulty bucket (`difficulty_of`).
DIFFICULTY = "difficulty"


@dataclass(frozen=True)
class Problem:
    task: str  # registry name of the task that made it
    index: int  # the index it was generated from within its split's stream
    question: str  # user message text
    answer: str  # reference answer (canonical string)
    key: str  # canonical identity of the problem; its hash decides the split
    # Task specific, JSON-serialisable; "difficulty" names the problem's bucket (`difficulty_of`).
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reward:
    correct: float  # 1.0 / 0.0, or the task's partial score in [0, 1]
    format: float  # format bonus actually granted (0.0 if none)

    @property
    def total(self) -> float:
        return self.correct + self.format

    @property
    def solved(self) -> bool:
        """Full credit. Accuracy counts these; partial scores are a training signal only."""
        return self.correct >= 1.0


class Task(Protocol):
    name: str

    def problem(self, split: Split, index: int) -> Problem:
        """Deterministic: the same (split, index) gives the same problem, forever."""
        ...

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages (role/content); the caller applies the tokenizer's chat template."""
        ...

    def extract_answer(self, completion: str) -> str | None: ...

    def reward(self, problem: Problem, completion: str) -> Reward: ...


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_heldout_fraction(heldout_fraction: float) -> None:
    if not (is_real(heldout_fraction) and 0.0 < heldout_fraction < 1.0):
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")


def check_format_weight(format_weight: float) -> None:
    if not (is_real(format_weight) and format_weight >= 0.0):  # NaN fails this too
        raise ValueError(f"format_weight must be >= 0, got {format_weight!r}")


def check_split(split: str, index: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"problem index must be an int >= 0, got {index!r}")


def split_of(key: str, heldout_fraction: float) -> Split:
    """The split a problem key belongs to.

    The first 8 bytes of SHA-256(key) read as a number in [0, 1); keys below `heldout_fraction`
    are held out. Python's hash() is salted per process and cannot be used. The held-out set for
    a smaller fraction is contained in the one for a larger fraction.
    """
    check_heldout_fraction(heldout_fraction)
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64
    return "heldout" if position < heldout_fraction else "train"


def candidate_seed(task_name: str, split: Split, index: int, attempt: int) -> int:
    """A 32-bit seed per candidate (32 bits because some generators hand it to numpy)."""
    digest = hashlib.sha256(f"{task_name}:{split}:{index}:{attempt}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big")


def draw_in_split(
    task_name: str,
    split: Split,
    index: int,
    heldout_fraction: float,
    candidate: Callable[[int], Problem],
) -> Problem:
    """The first candidate, over attempts 0, 1, 2, ..., whose key falls in `split`.

    `candidate(seed)` must be a pure function of the seed, which makes the result a pure function
    of (task_name, split, index).
    """
    check_split(split, index)
    check_heldout_fraction(heldout_fraction)
    fraction_of_split = heldout_fraction if split == "heldout" else 1.0 - heldout_fraction
    max_attempts = math.ceil(SPLIT_MISS_BUDGET / fraction_of_split)
    for attempt in range(max_attempts):
        problem = candidate(candidate_seed(task_name, split, index, attempt))
        if split_of(problem.key, heldout_fraction) == split:
            return problem
    raise RuntimeError(
        f"task {task_name!r} found no {split} problem for index {index} in {max_attempts} "
        f"candidates (heldout_fraction={heldout_fraction}); its problem space is too small "
        f"for this split"
    )


class SplitDrawn(ABC):
    """A problem generator split by key: `problem(split, index)` draws candidates from
    `_candidate(index, seed)` until one falls in `split` (`draw_in_split`)."""

    name: str
    heldout_fraction: float

    def problem(self, split: Split, index: int) -> Problem:
        return draw_in_split(self.name, split, index, self.heldout_fraction,
                             lambda seed: self._candidate(index, seed))

    @abstractmethod
    def _candidate(self, index: int, seed: int) -> Problem:
        """Problem `index`'s candidate for `seed`: a pure function of both."""


def difficulty_of(problem: Problem) -> str:
    """The problem's difficulty bucket within its task (the coordinator's pass-rate estimates are
    kept per bucket, coordinator/curriculum.py): what the task wrote in `metadata["difficulty"]`,
    else the question's length in words rounded to a power of two, since longer questions tend to be
    harder."""
    stated = problem.metadata.get(DIFFICULTY)
    if isinstance(stated, str):
        return stated
    words = max(1, len(problem.question.split()))
    return f"~{2 ** round(math.log2(words))} words"


def problems(task: Task, split: Split, count: int, start: int = 0) -> list[Problem]:
    """Problems start, start + 1, ..., start + count - 1 of a split."""
    return [task.problem(split, index) for index in range(start, start + count)]


def render_prompt(task: Task, problem: Problem, tokenizer: Any) -> list[int]:
    """Prompt token ids: the task's messages through the tokenizer's chat template."""
    encoded = tokenizer.apply_chat_template(
        task.messages(problem), add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding (a Mapping) by default; older ones a plain list.
    token_ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    if not all(isinstance(token_id, int) for token_id in token_ids):
        raise TypeError(
            f"apply_chat_template gave {type(token_ids).__name__} whose items are not all ints; "
            f"expected the token ids of one conversation"
        )
    return list(token_ids)
