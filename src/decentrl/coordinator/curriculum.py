"""Difficulty-aware scheduling: every group should teach something.

A group whose rows all earn the same reward has no advantage and trains nothing
(coordinator/ingest.py drops it). The coordinator keeps, from every scored group it accepts, online
estimates per difficulty bucket (the task's name and `tasks.base.difficulty_of`: for sums the
operands' digit counts and carries, for the calculator the length of its ideal chain of calls, for
countdown the count of numbers) and per problem key where a key comes back:

- per bucket, decayed counts of groups with and without reward spread, and of solved and unsolved
  rows. The chance that the bucket's next group has spread is estimated directly from the groups
  (Beta(1, 1) prior): a bucket mixes easy and hard problems, and its pass rate alone would
  overstate the spread of such a mix.
- per key, decayed counts of solved and unsolved rows. A key seen before gets its chance of
  spread from its own rows: its pass rate p has a Beta posterior (the prior: its bucket's pass
  rate, worth KEY_PRIOR_ROWS rows), and its next group of G rows has spread with chance
  1 - E[p^G] - E[(1-p)^G].

Every count decays with a half-life of `curriculum.half_life_groups` accepted groups, so the
estimates follow the policy as it improves: a bucket it masters loses its spread and is handed
out less, a bucket it starts to solve gains it.

Scheduling (`admits`): the seeded stream of problem indices stays as it was
(coordinator/scheduler.py); each candidate is handed out with probability
max(`curriculum.floor`, (c / b) ^ `curriculum.sharpness`), c its chance of spread and b the best
bucket's, decided by a draw seeded by the run's seed and the index, so a run is reproducible given
its accepted groups. Measured on the demo's base model, most groups of every bucket lack spread
(bench/README.md, curriculum), so the shares have to lean to the best buckets to matter: sharpness
above 1. The floor keeps every bucket in the stream, so its estimate keeps following the policy.
Peers play no part in the choice: the estimates come from the rewards the coordinator computed
itself on groups it accepted, for problems it handed out (a rollout's tokens are those of the seeded
sampling, which spot-checks hold peers to), and problems come from the train split only.

Replays (`curriculum.replay_share` > 0): a bucket mixes problems the policy always solves with
problems it never does, so even the best bucket's groups lack spread a third to half of the time
(the #21 demo: 57% of groups without spread, best bucket's chance 0.64). A problem whose newest
group had spread, and whose rows so far say the next one will likely have it too (chance >=
REPLAY_MIN_CHANCE from its key's estimate: 0.5 to 0.96 after one group of 1 to 7 solved rows
out of 8), is queued to be handed out again, up to `curriculum.max_replays` times, newest
evidence first; `next_replay` hands out queued problems for about `replay_share` of the
scheduled slots. The coordinator alone decides,
from its own scoring of groups it accepted; a replay is a train problem the seeded stream handed
out before, under an index of its own (coordinator/scheduler.py), so it gets fresh samples.

A floor under every bucket (`curriculum.min_level_share` > 0): the chances of spread can differ
so much between buckets that the hard ones starve (countdown on the 135M model: 0.79-0.98 for 2
numbers against 0.22-0.31 for 3 and 4, so RL trained on 2 numbers and lost on 3 and 4;
docs/agentic.md). A bucket's share is its part of the accepted groups, decayed as the estimates
are. While a bucket seen so far is below the share, every candidate of it is handed out, the
other buckets' candidates are passed over and only its own problems are replayed; a bucket not
seen yet counts as below. So each bucket keeps about the share, give or take the groups in flight
when it crosses it, whatever its chance of spread; the rest follows the estimates as above. A
bucket the stream offers seldom is caught up on by passing over more candidates (the stream has
no end). 0 leaves the scheduling as above.

A restarted coordinator replays the stored accepted groups in acceptance order (`replay`) and so
gets the same estimates back, and the same queue of problems to hand out again."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from decentrl.config import CurriculumConfig
from decentrl.coordinator.scheduler import replay_attempt, replay_index, source_index
from decentrl.envs import Environment
from decentrl.learn.advantages import zero_variance_groups
from decentrl.rollout.types import ScoredGroup
from decentrl.tasks import Task
from decentrl.tasks.base import Problem, difficulty_of

# How many rows of its bucket's pass rate a problem key's prior is worth: few, since problems
# of one bucket range from always to never solved, so a key's own rows soon say more.
KEY_PRIOR_ROWS = 2.0
# Problem keys kept. Keys are the coordinator's own problems (peers cannot add any), so this
# bounds memory over a long run, not an attacker; the least recently seen key goes first.
MAX_KEYS = 100_000
# Buckets reported in the metrics: the most observed ones (a task with many buckets would
# otherwise flood each step's line).
REPORTED_BUCKETS = 16
# A problem whose newest group had spread is queued for another when its chance of spread is at
# least this. Low enough for one success in 8 rows of a hard bucket (0.5): rare successes are
# what the policy has most to learn from.
REPLAY_MIN_CHANCE = 0.5
# Problems waiting to be handed out again; past this the oldest evidence goes first.
MAX_REPLAY_QUEUE = 4096
# Replays owed beyond the current slot: a queue that was empty for a while is caught up on
# gradually, not with a burst of repeats.
MAX_REPLAY_CREDIT = 2.0


def bucket_of(problem: Problem) -> str:
    """The difficulty bucket of a problem: its task and its difficulty within it."""
    return f"{problem.task} {difficulty_of(problem)}"


def has_spread(rewards: list[float]) -> bool:
    """Whether a group's rewards differ: the batch's zero-variance filter's own rule."""
    return not bool(zero_variance_groups(torch.tensor(rewards), len(rewards))[0])


def spread_chance(solved: float, unsolved: float, group_size: int) -> float:
    """The chance that `group_size` rows are neither all solved nor all unsolved, when each is
    solved with a pass rate p ~ Beta(solved, unsolved): 1 - E[p^G] - E[(1-p)^G]."""
    all_solved = all_unsolved = 1.0
    for row in range(group_size):
        all_solved *= (solved + row) / (solved + unsolved + row)
        all_unsolved *= (unsolved + row) / (solved + unsolved + row)
    return 1.0 - all_solved - all_unsolved


@dataclass(frozen=True)
class DecayedCounts:
    """Counts that lose half their weight every half-life of the curriculum's clock."""

    solved: float = 0.0  # rows
    unsolved: float = 0.0
    spread: float = 0.0  # groups with reward spread
    flat: float = 0.0  # groups without
    clock: int = 0  # the curriculum's clock the counts stand at

    def at(self, clock: int, keep_per_group: float) -> DecayedCounts:
        """These counts as they stand at `clock`."""
        factor = keep_per_group ** (clock - self.clock)
        return DecayedCounts(self.solved * factor, self.unsolved * factor, self.spread * factor,
                             self.flat * factor, clock)

    def plus(self, solved: float, unsolved: float, spread: bool) -> DecayedCounts:
        """These counts and one more group's."""
        return DecayedCounts(self.solved + solved, self.unsolved + unsolved,
                             self.spread + spread, self.flat + (not spread), self.clock)

    @property
    def pass_rate(self) -> float:
        """Posterior mean under a Beta(1, 1) prior."""
        return (self.solved + 1.0) / (self.solved + self.unsolved + 2.0)

    @property
    def spread_rate(self) -> float:
        """Posterior mean of the chance of spread under a Beta(1, 1) prior."""
        return (self.spread + 1.0) / (self.spread + self.flat + 2.0)


@dataclass(frozen=True)
class BucketEstimate:
    bucket: str
    groups: float  # decayed
    pass_rate: float
    spread_chance: float


class Curriculum:
    """The coordinator's pass-rate estimates and the admission of scheduled problems. Thread
    safe: the loop observes groups while generation threads schedule. Reading an estimate
    changes nothing, so a replay of the same groups gives exactly the same estimates."""

    def __init__(self, config: CurriculumConfig, task: Task | Environment, group_size: int,
                 seed: int) -> None:
        self.config, self.task, self.group_size, self.seed = config, task, group_size, seed
        self.keep_per_group = 0.5 ** (1.0 / config.half_life_groups)
        self.clock = 0  # accepted groups observed
        self.flat_groups = 0  # of them, without reward spread (undecayed)
        self.buckets: dict[str, DecayedCounts] = {}
        self.keys: OrderedDict[str, DecayedCounts] = OrderedDict()
        # Source index -> the attempt it is next handed out as, and its bucket; the newest
        # evidence last.
        self.replays: OrderedDict[int, tuple[int, str]] = OrderedDict()
        self.replay_credit = 0.0
        self.replays_handed_out = 0
        self._lock = threading.Lock()

    def observe(self, scored: ScoredGroup) -> None:
        """One accepted group, scored by the coordinator."""
        index = scored.group.problem_index
        source, attempt = source_index(index), replay_attempt(index)
        problem = self.task.problem("train", source)
        spread = has_spread(scored.rewards)
        solved = sum(scored.correct)
        unsolved = len(scored.correct) - solved
        with self._lock:
            self.clock += 1
            self.flat_groups += not spread
            for table, name in ((self.buckets, bucket_of(problem)), (self.keys, problem.key)):
                counts = self._now(table.get(name)) or DecayedCounts(clock=self.clock)
                table[name] = counts.plus(solved, unsolved, spread)
            self.keys.move_to_end(problem.key)
            if len(self.keys) > MAX_KEYS:
                self.keys.popitem(last=False)
            # The newest group of a problem decides whether it goes back in the queue.
            self.replays.pop(source, None)
        if (spread and self.config.replay_share > 0 and attempt < self.config.max_replays
                and self.chance(problem) >= REPLAY_MIN_CHANCE):
            with self._lock:
                self.replays[source] = (attempt + 1, bucket_of(problem))
                if len(self.replays) > MAX_REPLAY_QUEUE:
                    self.replays.popitem(last=False)

    def _now(self, counts: DecayedCounts | None) -> DecayedCounts | None:
        return None if counts is None else counts.at(self.clock, self.keep_per_group)

    def replay(self, groups: Iterable[ScoredGroup]) -> None:
        """Observe stored groups again, in acceptance order: a restarted coordinator's estimates."""
        for scored in groups:
            self.observe(scored)

    def chance(self, problem: Problem) -> float:
        """The estimated chance that a group of `problem` has reward spread."""
        with self._lock:
            bucket = self._now(self.buckets.get(bucket_of(problem)))
            key = self._now(self.keys.get(problem.key))
        if key is None:
            return 0.5 if bucket is None else bucket.spread_rate
        prior = 0.5 if bucket is None else bucket.pass_rate
        return spread_chance(key.solved + KEY_PRIOR_ROWS * prior,
                             key.unsolved + KEY_PRIOR_ROWS * (1.0 - prior), self.group_size)

    def admits(self, index: int) -> bool:
        """Whether train problem `index` of the seeded stream is handed out: always when the
        curriculum is off, else with its chance of spread relative to the best bucket's, to the
        power `sharpness`, at least the floor; with `min_level_share`, always while its bucket
        is below the share, never while another is."""
        if not self.config.enabled:
            return True
        problem = self.task.problem("train", index)
        if self.config.min_level_share > 0:
            with self._lock:
                shares = self._shares()
            if shares.get(bucket_of(problem), 0.0) < self.config.min_level_share:
                return True
            if shares and min(shares.values()) < self.config.min_level_share:
                return False  # another bucket is below its share: this one waits
        relative = min(1.0, self.chance(problem) / self.best_chance())
        chance = max(self.config.floor, relative ** self.config.sharpness)
        # Seeded by the run and the index alone: the same estimates give the same choice.
        return random.Random(f"curriculum:{self.seed}:{index}").random() < chance

    def next_replay(self) -> int | None:
        """The index to hand out a queued problem again under, or None: for about
        `replay_share` of the slots asked for while the queue has problems (with
        `min_level_share`, only problems of a bucket below the share while there is one)."""
        if not self.config.enabled or self.config.replay_share == 0:
            return None
        with self._lock:
            self.replay_credit = min(MAX_REPLAY_CREDIT,
                                     self.replay_credit + self.config.replay_share)
            if not self.replays or self.replay_credit < 1.0:
                return None
            shares = self._shares() if self.config.min_level_share > 0 else {}
            starved = {bucket for bucket, share in shares.items()
                       if share < self.config.min_level_share}
            # The newest evidence first, of a bucket below its share while there is one.
            source = next((source for source, (_, bucket) in reversed(self.replays.items())
                           if not starved or bucket in starved), None)
            if source is None:
                return None  # the slot goes to the stream, which hands out the starved buckets
            attempt, _ = self.replays.pop(source)
            self.replay_credit -= 1.0
            self.replays_handed_out += 1
        return replay_index(source, attempt)

    def _shares(self) -> dict[str, float]:
        """Each bucket's share of the accepted groups, decayed (under the lock); {} before any."""
        groups = {name: counts.at(self.clock, self.keep_per_group)
                  for name, counts in self.buckets.items()}
        total = sum(counts.spread + counts.flat for counts in groups.values())
        if total <= 0:
            return {}
        return {name: (counts.spread + counts.flat) / total for name, counts in groups.items()}

    def best_chance(self) -> float:
        """The highest chance of spread among the buckets (that of a bucket not seen yet, 0.5,
        before any)."""
        with self._lock:
            return max((counts.at(self.clock, self.keep_per_group).spread_rate
                        for counts in self.buckets.values()), default=0.5)

    def estimates(self) -> list[BucketEstimate]:
        """The most observed buckets' estimates, most observed first."""
        with self._lock:
            buckets = [(name, counts.at(self.clock, self.keep_per_group))
                       for name, counts in self.buckets.items()]
        buckets.sort(key=lambda item: -(item[1].spread + item[1].flat))
        return [BucketEstimate(name, counts.spread + counts.flat, counts.pass_rate,
                               counts.spread_rate)
                for name, counts in buckets[:REPORTED_BUCKETS]]

    def counters(self) -> dict[str, Any]:
        """StepRecord fields: the share of accepted groups without spread so far, the problems
        handed out again so far, and each reported bucket's estimated pass rate and chance of
        spread."""
        estimates = self.estimates()
        with self._lock:
            flat_share = self.flat_groups / self.clock if self.clock else None
            replays = self.replays_handed_out
        return {"zero_spread_share_total": flat_share, "replays_handed_out": replays,
                "bucket_pass_rates": {e.bucket: round(e.pass_rate, 4) for e in estimates},
                "bucket_spread_chances": {e.bucket: round(e.spread_chance, 4)
                                          for e in estimates}}
