"""What the run report (observe/report.py) reads from a run folder beyond its metrics (the
evaluations, the run store) and the figures it derives from the step records: staleness counts,
rollout groups by fate, throughput, step times."""

from __future__ import annotations

import math
import sqlite3
from collections import Counter
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from decentrl.evaluate.runner import EvalResult
from decentrl.observe.metrics import StepRecord, SwarmRecord

# Reward and accuracy closer than this at every step are one series (no format bonus).
SAME_SERIES_TOLERANCE = 1e-6
# Steps per throughput point: one step's interval is noisy (a batch can wait on a slow replica).
THROUGHPUT_WINDOW = 5


def read_evaluation(path: Path) -> EvalResult | None:
    """eval_before.json or eval_after.json; None when the run has none."""
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=EvalResult)
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not an evaluation result: {error}") from None


def staleness_counts(steps: Sequence[StepRecord], store: Path) -> dict[int, int]:
    """Groups trained per staleness (in versions). From the step records; runs from before they
    carried the counts fall back on the run store's trained groups."""
    if any(r.staleness_counts is None for r in steps) and store.is_file():
        return stored_staleness_counts(store)
    total: Counter[int] = Counter()
    for record in steps:
        total.update(record.staleness_counts or {})
    return dict(sorted(total.items()))


def query_store(store: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query on the run store; none when there is no store we can read (the sections
    then say so)."""
    if not store.is_file():
        return []
    # Read-only: the report must never change a run's durable state.
    try:
        # closing(): a connection's own context manager ends a transaction, not the connection.
        with closing(sqlite3.connect(f"{store.resolve().as_uri()}?mode=ro", uri=True)) as db:
            return db.execute(sql).fetchall()
    except sqlite3.Error:
        return []


def stored_staleness_counts(store: Path) -> dict[int, int]:
    rows = query_store(store, "SELECT staleness, COUNT(*) FROM groups WHERE state = 'trained' "
                              "GROUP BY staleness ORDER BY staleness")
    return {int(staleness): int(count) for staleness, count in rows}


@dataclass(frozen=True)
class GroupTotals:
    """Accepted rollout groups by what became of them. Without a run store only the trained ones
    are known (from the step records), so `pending` and `dropped` are None."""

    trained: int
    pending: int | None = None
    dropped: int | None = None

    @property
    def accepted(self) -> int | None:
        if self.pending is None or self.dropped is None:
            return None
        return self.trained + self.pending + self.dropped


def group_totals(steps: Sequence[StepRecord], store: Path) -> GroupTotals:
    states = {str(state): int(count) for state, count in
              query_store(store, "SELECT state, COUNT(*) FROM groups GROUP BY state")}
    if not states:
        return GroupTotals(trained=round(sum(r.groups for r in steps)))
    return GroupTotals(states.get("trained", 0), states.get("pending", 0),
                       states.get("dropped", 0))


def peers_seen(snapshots: Sequence[SwarmRecord]) -> int:
    return len({p.peer_id for s in snapshots for p in s.peers})


def reward_accuracy_series(steps: Sequence[StepRecord]) -> list[tuple[str, list[float]]]:
    """(label, values) of each line to draw: one when reward and accuracy are the same series
    (a task without a format bonus rewards exactly the solved rollouts), else both."""
    rewards, accuracies = [r.reward for r in steps], [r.accuracy for r in steps]
    if all(math.isclose(r, a, rel_tol=0.0, abs_tol=SAME_SERIES_TOLERANCE)
           for r, a in zip(rewards, accuracies)):
        return [("reward = accuracy", rewards)]
    return [("reward", rewards), ("accuracy", accuracies)]


def generated_tokens(record: StepRecord, group_size: int) -> float:
    """Completion tokens of the step's batch; older records only have the mean per rollout."""
    if record.generated_tokens is not None:
        return record.generated_tokens
    return record.completion_tokens_mean * record.groups * group_size


@dataclass(frozen=True)
class ThroughputPoint:
    elapsed_s: float
    tokens_per_s: float
    steps_per_min: float


def throughput(steps: Sequence[StepRecord], group_size: int) -> list[ThroughputPoint]:
    """Generated tokens per second and steps per minute over the last THROUGHPUT_WINDOW steps,
    at each step. The first step has no interval before it (the run started with an evaluation),
    so the series starts at the second."""
    points = []
    for index in range(1, len(steps)):
        start = max(0, index - THROUGHPUT_WINDOW)
        seconds = steps[index].elapsed_s - steps[start].elapsed_s
        if seconds <= 0:
            continue  # a resumed run restarts its clock
        tokens = sum(generated_tokens(r, group_size) for r in steps[start + 1:index + 1])
        points.append(ThroughputPoint(steps[index].elapsed_s, tokens / seconds,
                                      60 * (index - start) / seconds))
    return points


def mean_of(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def timed_steps(steps: Sequence[StepRecord]) -> list[tuple[int, float, float]]:
    """(step, seconds waiting for rollouts, seconds training) of the records that logged both."""
    return [(r.step, r.wait_s, r.train_s) for r in steps
            if r.wait_s is not None and r.train_s is not None]
