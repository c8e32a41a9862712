"""Accepted groups on their way into a batch: the loop's intake. A group that arrives is judged by
the trust gate, checked and scored by ingestion (coordinator/ingest.py) and stored before it
counts; it then waits in `pending`, or in `held` while a spot-check picked it and its ruling is
not in (verdict before influence). A batch takes pending groups first, re-checked for staleness,
then new arrivals from the transport."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from decentrl.config import RunConfig
from decentrl.coordinator.backend import Gate
from decentrl.coordinator.curriculum import Curriculum, has_spread
from decentrl.coordinator.ingest import Ingestion
from decentrl.coordinator.store import RunStore
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.net.transport import RolloutTransport
from decentrl.rollout.types import RolloutGroup, ScoredGroup

log = logging.getLogger(__name__)

POLL_S = 0.5
# Dynamic sampling reads at most this many groups per group a batch asks for: when the policy
# solves (or fails) nearly every problem, a step still comes, with the few groups that vary.
DYNAMIC_SAMPLING_LIMIT = 4

Pooled = tuple[ScoredGroup, int]  # an accepted group and its staleness when it was accepted


class GroupPool:
    def __init__(self, config: RunConfig, store: RunStore, ingestion: Ingestion,
                 curriculum: Curriculum, gate: Gate, transport: RolloutTransport) -> None:
        self.config, self.store, self.ingestion = config, store, ingestion
        self.curriculum, self.gate, self.transport = curriculum, gate, transport
        self.pending: list[Pooled] = []  # accepted, not yet trained
        self.held: list[Pooled] = []  # accepted, waiting for a check's ruling

    def reload(self) -> None:
        """Pending again what the store holds pending (at the start, and after a rollback). Held
        groups are pending in the store: those still pending are in `pending` now (and go back
        to `held` while they await a ruling); those a rollback discarded must not come back."""
        self.pending = [(g.scored, g.staleness) for g in self.store.pending_groups()]
        self.held = []

    def requeue(self, groups: Sequence[Pooled]) -> None:
        """Groups of a step that failed, first in line for the next one."""
        self.pending[:0] = groups

    def drain(self, keep: Callable[[RolloutGroup], bool], version: int) -> None:
        """Accept, at the learner's `version`, the groups waiting in the transport now that
        `keep` passes."""
        while (group := self.transport.get_rollouts(timeout=0)) is not None:
            if keep(group):
                accepted = self.accept(group, version)
                if accepted is not None:
                    self.pending.append(accepted)

    def accept(self, group: RolloutGroup, version: int) -> Pooled | None:
        """Check, score and store one group at the learner's `version`; None when it is
        refused."""
        distrusted = self.gate.distrusted_producer(group.group_id)
        if distrusted is not None:
            self.ingestion.stats.count_rejection("distrusted")
            self.gate.forget(group.group_id)
            log.warning("rejected group %s: %s", group.group_id, distrusted)
            return None
        accepted = self.ingestion.ingest(group, version)
        if accepted is None:
            self.gate.forget(group.group_id)
            return None
        self.store.add_group(accepted[0], accepted[1], version)
        self.curriculum.observe(accepted[0])
        self.gate.accepted(group)
        return accepted

    def still_trainable(self, scored: ScoredGroup, version: int) -> int | None:
        """A pending group's staleness now, or None (dropped, with the reason stored) when its
        producer was banned or it fell past the staleness bound while it waited."""
        group_id = scored.group.group_id
        distrusted = self.gate.distrusted_producer(group_id)
        if distrusted is not None:
            self.store.mark_dropped([group_id], distrusted)
            return None
        try:
            return check_staleness(version, scored.group.stage_versions,
                                   self.config.train.max_staleness)
        # ValueError: versions the learner never had (a rollback's leftovers).
        except (StaleRolloutError, ValueError) as error:
            self.store.mark_dropped([group_id], str(error))
            self.ingestion.stats.stale += isinstance(error, StaleRolloutError)
            return None

    def teaches(self, scored: ScoredGroup) -> bool:
        """Whether a group counts towards a batch: every group does, except under dynamic
        sampling, where only a group whose rewards vary does (the others carry no gradient)."""
        return not self.config.train.dynamic_sampling or has_spread(scored.rewards)

    def batch_limit(self, needed: int) -> int:
        return needed * DYNAMIC_SAMPLING_LIMIT if self.config.train.dynamic_sampling else needed

    def collect(self, needed: int, version: int, stop: threading.Event,
                generation_error: Callable[[], BaseException | None]) -> list[Pooled]:
        """Accepted groups within the staleness bound for one batch at the learner's `version`:
        first those accepted earlier and not yet trained (re-checked, they may have gone stale),
        then new arrivals. Under dynamic sampling `needed` counts groups whose rewards vary; the
        others come along (they are recorded as trained) until the batch holds `batch_limit`
        groups. Raises once a generation loop failed or the run was stopped."""
        batch: list[Pooled] = []
        teaching = 0
        while teaching < needed and len(batch) < self.batch_limit(needed):
            self.hold_unjudged()
            if self.pending:
                scored, _ = self.pending.pop(0)
                staleness = self.still_trainable(scored, version)
                if staleness is not None:
                    batch.append((scored, staleness))
                    teaching += self.teaches(scored)
                continue
            failed = generation_error()
            if failed is not None:
                raise RuntimeError("generation failed") from failed
            if stop.is_set():
                raise RuntimeError("the run was stopped while waiting for rollouts")
            group = self.transport.get_rollouts(timeout=POLL_S)
            if group is not None:
                accepted = self.accept(group, version)
                if accepted is not None:
                    self.pending.append(accepted)
        return batch

    def hold_unjudged(self) -> None:
        """Verdict before influence: groups picked for a check wait in `held` until their ruling,
        then join the pending ones (a failed one is dropped there, like any distrusted group)."""
        waiting = self.held + self.pending
        awaiting = [self.gate.awaiting_verdict(item[0].group.group_id) for item in waiting]
        self.held = [item for item, held in zip(waiting, awaiting) if held]
        self.pending = [item for item, held in zip(waiting, awaiting) if not held]
