"""Any reasoning-gym dataset as a task, registered as "rg:<dataset>" (e.g. "rg:countdown").

Each candidate problem is entry 0 of `create_dataset(dataset, seed=seed, size=1)`: reasoning-gym
entries are pure functions of (config, seed + idx), so a seed names one problem. The split key is
the question text, which for these generators identifies the problem.

Scoring uses the dataset's own `score_answer` on the text inside the last <answer></answer> tags.
Some datasets give partial credit (countdown 0.05 for a wrong expression, gsm_symbolic 0.01 for a
wrong number, chain_sum len(reference)/len(answer) when the answer contains the reference);
`Reward.solved` is what accuracy should count.

Problem.metadata holds the dataset name, the seed and a JSON copy of the entry (for reading and
logging). Scoring rebuilds the exact entry from the seed instead of trusting the copy, because a
JSON round trip is lossy for some datasets: arc_agi compares tuple grids, which come back as lists
and never compare equal.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS
from reasoning_gym.utils import extract_answer as extract_tagged_answer

from decentrl.tasks.base import (
    Problem,
    Reward,
    SplitDrawn,
    check_format_weight,
    check_heldout_fraction,
)

TASK_PREFIX = "rg:"
SYSTEM_PROMPT = SYSTEM_PROMPTS["default"]
# We derive the seed of every problem ourselves and always build one entry at a time.
RESERVED_CONFIG_OPTIONS = ("seed", "size")
# Entries kept per task: the problems drawn recently are the ones being scored.
ENTRY_CACHE_SIZE = 4096


def dataset_names() -> list[str]:
    return sorted(DATASETS)


class ReasoningGymTask(SplitDrawn):
    def __init__(
        self,
        dataset: str,
        heldout_fraction: float = 0.1,
        format_weight: float = 0.1,
        config: dict[str, Any] | None = None,
    ) -> None:
        if dataset not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; known datasets: "
                f"{', '.join(dataset_names())}"
            )
        check_heldout_fraction(heldout_fraction)
        check_format_weight(format_weight)
        config = dict(config or {})
        for option in RESERVED_CONFIG_OPTIONS:
            if option in config:
                raise ValueError(
                    f"config option {option!r} of reasoning-gym dataset {dataset!r} is set by "
                    f"decentrl per problem; remove it"
                )
        self.name = TASK_PREFIX + dataset
        self.dataset = dataset
        self.heldout_fraction = heldout_fraction
        self.format_weight = format_weight
        self.config = config
        # One dataset object knows how to score every entry; building it also validates the config.
        self._scorer = self._build_dataset(seed=0)
        self._entry = functools.lru_cache(maxsize=ENTRY_CACHE_SIZE)(self._generate_entry)

    def _build_dataset(self, seed: int) -> Any:
        try:
            return reasoning_gym.create_dataset(self.dataset, seed=seed, size=1, **self.config)
        except (TypeError, ValueError, AssertionError) as error:
            # reasoning-gym reports unknown options as TypeError and bad values as AssertionError.
            raise ValueError(
                f"invalid config {self.config!r} for reasoning-gym dataset {self.dataset!r}: "
                f"{error}"
            ) from error

    def _generate_entry(self, seed: int) -> dict[str, Any]:
        return self._build_dataset(seed)[0]

    def _candidate(self, index: int, seed: int) -> Problem:
        entry = self._entry(seed)
        return Problem(
            task=self.name,
            index=index,
            question=entry["question"],
            answer=str(entry["answer"]),
            key=entry["question"],
            # default=str keeps the copy JSON-serialisable whatever a generator puts in it.
            metadata={
                "dataset": self.dataset,
                "seed": seed,
                "entry": json.loads(json.dumps(entry, default=str)),
            },
        )

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
        ]

    def extract_answer(self, completion: str) -> str | None:
        """The stripped text inside the last <answer></answer> pair, or None without one."""
        return extract_tagged_answer(completion)

    def reward(self, problem: Problem, completion: str) -> Reward:
        if problem.task != self.name:
            raise ValueError(f"task {self.name!r} cannot score a problem of task {problem.task!r}")
        entry = self._entry(problem.metadata["seed"])
        if entry["question"] != problem.question:
            raise ValueError(
                f"problem {problem.task}:{problem.index} does not come from this task's config "
                f"{self.config!r}: seed {problem.metadata['seed']} rebuilds a different question"
            )
        extracted = self.extract_answer(completion)
        # No answer earns nothing, even where score_answer(None) has a floor (countdown: 0.01).
        correct = 0.0 if extracted is None else float(self._scorer.score_answer(extracted, entry))
        return Reward(
            correct=correct,
            format=self.format_weight if extracted is not None else 0.0,
        )
