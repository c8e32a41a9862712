"""The "count-letters" task: how many times a letter appears in a word ("strawberry" has three r).

Written like decentrl's built-in tasks: `SplitDrawn` draws problem `index` of a split from seeded
candidates, and a problem's key ("strawberry:r") decides by its hash whether it is held out, on
every machine and whatever the options. The reward reads the last number of the completion.
"""

from __future__ import annotations

import random
import re

from decentrl.tasks import Problem, Reward
from decentrl.tasks.arithmetic import last_number
from decentrl.tasks.base import DIFFICULTY, SplitDrawn, check_format_weight, check_heldout_fraction

WORDS: tuple[str, ...] = (
    "apple", "banana", "bookkeeper", "cherry", "coffee", "committee", "dragonfly", "elephant",
    "giraffe", "hippopotamus", "mississippi", "necessary", "occurrence", "parallel", "pepper",
    "raspberry", "strawberry", "success", "tomorrow", "umbrella", "vacuum", "woodpecker",
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# A completion earns the format bonus when it is the bare count, optionally with a period.
WELL_FORMED_RE = re.compile(r"\d+\.?")


class CountLettersTask(SplitDrawn):
    # The entry point's name in pyproject.toml: decentrl refuses a task that carries another.
    name = "count-letters"

    def __init__(self, absent_letters: float = 0.2, heldout_fraction: float = 0.1,
                 format_weight: float = 0.1) -> None:
        if not 0.0 <= absent_letters < 1.0:
            raise ValueError(f"absent_letters must be in [0, 1), got {absent_letters!r}")
        check_heldout_fraction(heldout_fraction)
        check_format_weight(format_weight)
        self.absent_letters = absent_letters  # the share of questions whose answer is 0
        self.heldout_fraction = heldout_fraction
        self.format_weight = format_weight

    def _candidate(self, index: int, seed: int) -> Problem:
        rng = random.Random(seed)
        word = rng.choice(WORDS)
        absent = [letter for letter in ALPHABET if letter not in word]
        letter = rng.choice(absent if rng.random() < self.absent_letters else sorted(set(word)))
        count = word.count(letter)
        return Problem(
            task=self.name,
            index=index,
            question=f"How many times does the letter {letter!r} appear in the word {word!r}? "
                     "Answer with just the number.",
            answer=str(count),
            key=f"{word}:{letter}",
            metadata={"word": word, "letter": letter,
                      DIFFICULTY: f"{count} times" if count < 3 else "3+ times"},
        )

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.question}]

    def extract_answer(self, completion: str) -> str | None:
        return last_number(completion)

    def reward(self, problem: Problem, completion: str) -> Reward:
        correct = self.extract_answer(completion) == problem.answer
        well_formed = WELL_FORMED_RE.fullmatch(completion.strip()) is not None
        return Reward(correct=1.0 if correct else 0.0,
                      format=self.format_weight if well_formed else 0.0)
