"""The loop's generation: as many generation loops as the backend's `Generation` allows, each
taking a session slot, scheduling problems (durably, so a restart never hands one out twice),
generating their groups through the backend's chain and putting them into the transport, until
the run stops. A group sampled by weights that a rollback discarded is dropped (`rollbacks`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from decentrl.coordinator.backend import Backend
from decentrl.coordinator.ingest import IngestStats
from decentrl.coordinator.pool import POLL_S
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.store import RunStore
from decentrl.coordinator.worker import RolloutWorker
from decentrl.rollout.chain import InferenceSession
from decentrl.rollout.types import RolloutGroup

log = logging.getLogger(__name__)


def from_discarded_branch(group: RolloutGroup, version: int, stats: IngestStats) -> bool:
    """Whether `group` sampled with weights newer than `version`, the one a rollback went back
    to: those version numbers name other weights from then on (checked against them, an honest
    replica would fail). Logged, and counted in `stats`, to be dropped."""
    newest = max(v for span in group.version_spans for v in span.versions)
    if newest <= version:
        return False
    stats.count_rejection("rolled back")
    log.warning("dropped group %s: sampled at v%d, which the rollback to v%d discarded",
                group.group_id, newest, version)
    return True


class GenerationLoops:
    def __init__(self, backend: Backend, worker: RolloutWorker, scheduler: PromptScheduler,
                 store: RunStore, stats: IngestStats, stop: threading.Event,
                 before_round: Callable[[threading.Event], bool],
                 after_round: Callable[[bool], None]) -> None:
        """`before_round` runs before a loop schedules problems (False skips the round: the run's
        hooks may hold generation), `after_round` after it, told whether it succeeded."""
        self.backend, self.generation = backend, backend.generation
        self.worker, self.scheduler, self.store, self.stats = worker, scheduler, store, stats
        self.stop, self.before_round, self.after_round = stop, before_round, after_round
        self.problems_lock = threading.Lock()
        self.rollbacks: list[int] = []  # the version each rollback of this run went back to
        self.errors = 0  # rounds lost to transient errors
        self.error: BaseException | None = None  # what stopped a generation loop, if anything

    def threads(self) -> list[threading.Thread]:
        """The generation loops, not started yet."""
        return [threading.Thread(target=self.run_forever, name=f"generate-{i}", daemon=True)
                for i in range(self.generation.loops)]

    def schedule(self, count: int) -> list[int]:
        with self.problems_lock:  # durable first: a restart never hands a problem out twice
            return self.scheduler.next(count, reserve=self.store.reserve_problems)

    def generate(self, count: int) -> list[RolloutGroup]:
        """The groups of `count` problems, generated now, less those a rollback discarded
        meanwhile."""
        sessions: list[InferenceSession] = []
        rollbacks_before = len(self.rollbacks)
        self.worker.sync_weights()
        groups = self.worker.generate_groups(self.schedule(count), on_session=sessions.append)
        self.backend.generated(groups, sessions)
        # A rollback while these sessions ran may have discarded the versions they sampled with.
        floor = min(self.rollbacks[rollbacks_before:], default=None)
        return [g for g in groups
                if floor is None or not from_discarded_branch(g, floor, self.stats)]

    def run_forever(self) -> None:
        """One generation loop: problems in, groups into the transport, until the run stops.
        Transient errors (a group lost with its peers) are logged and retried with backoff;
        anything else stops the run and is raised by the training loop."""
        generation = self.generation
        try:
            if generation.cpu_threads is not None:
                torch.set_num_threads(generation.cpu_threads)
            attempt = 0
            while not self.stop.is_set():
                if not self.before_round(self.stop):
                    continue
                self.backend.await_servers(self.stop)
                if not generation.slots.acquire(self.stop):
                    break
                groups: list[RolloutGroup] | None = None
                try:
                    groups = self.generate(generation.problems_per_session)
                    attempt = 0
                except generation.transient_errors as error:
                    self.errors += 1
                    log.warning("generation failed: %s", error)
                    self.after_round(False)
                finally:  # the session is over: its slot is free before any wait below
                    generation.slots.release()
                if groups is None:
                    attempt += 1
                    self.stop.wait(min(10.0, 0.5 * 2 ** attempt))
                    continue
                self.after_round(True)
                for group in groups:
                    # A full inbox means the learner is behind; wait rather than generate more.
                    while not self.stop.is_set() \
                            and not generation.transport.put_rollouts(group, POLL_S):
                        pass
        except BaseException as error:  # noqa: BLE001 - raised by the training loop
            log.exception("a generation loop failed")
            self.error = error
            self.stop.set()
