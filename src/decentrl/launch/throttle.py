"""A home uplink throttled hard mid-run (`decentrl demo --netns`), and where the coordinator's
routing sent new generation sessions before and after.

Routing (net/directory.py `choose_inference`) knows nothing of uplinks: it gives a new session to
the replica with the fewest sessions open from the coordinator, then the lowest measured
latency. A replica behind a throttled uplink answers each step slower, so its sessions stay
open longer and its latency grows; new sessions go elsewhere. This hook throttles the uplink and
keeps the per-replica session counts at that moment and at the end of training."""

from __future__ import annotations

import time
from dataclasses import dataclass

from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.net.directory import Directory
from decentrl.net.netns import Internet
from decentrl.observe.metrics import StepRecord


@dataclass(frozen=True)
class RoutingShare:
    """One inference replica's new sessions before the throttle and after it, and what share of
    its stage's new sessions each was."""

    name: str
    stage: int
    throttled: bool  # behind the throttled uplink
    before: int
    after: int
    share_before: float
    share_after: float


class ThrottleHalfway(RunHooks):
    """Halfway through training (its time budget, or its steps where it has none), caps home
    `home`'s uplink at `mbit`, and sets it back to `restore_mbit` when training ends (the final
    evaluation measures the model, not the throttle); `behind` are the peer ids of that home's
    peers."""

    def __init__(self, internet: Internet, home: int, mbit: float, restore_mbit: float,
                 directory: Directory, behind: set[str]) -> None:
        if home not in internet.routers:
            raise ValueError(f"no home {home} on this internet (homes: {sorted(internet.routers)})")
        self.internet, self.home, self.mbit, self.directory = internet, home, mbit, directory
        self.restore_mbit = restore_mbit
        self.behind = behind  # peer ids of the home's hosts
        self.began = 0.0
        self.throttled_at_step: int | None = None
        self.at_throttle: dict[str, int] = {}
        self.at_end: dict[str, int] = {}

    def training_started(self, loop: TrainingLoop) -> None:
        self.began = time.monotonic()

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        if self.throttled_at_step is not None:
            return
        budget = loop.config.train.time_budget_s
        halfway = time.monotonic() - self.began >= budget / 2 if budget is not None \
            else record.step >= loop.config.train.steps / 2
        if halfway:
            self.internet.throttle(self.home, self.mbit)
            self.at_throttle = self.directory.sessions_opened()
            self.throttled_at_step = record.step
            loop.console.print(f"throttled home{self.home}'s uplink to {self.mbit:g} Mbit/s after "
                               f"step {record.step}")

    def training_ended(self, loop: TrainingLoop) -> None:
        self.at_end = self.directory.sessions_opened()
        if self.throttled_at_step is not None:
            self.internet.throttle(self.home, self.restore_mbit)
            loop.console.print(f"home{self.home}'s uplink back to {self.restore_mbit:g} Mbit/s")

    def shares(self) -> list[RoutingShare]:
        """Per inference replica still announced at the end, by stage and name."""
        records = self.directory.records()
        replicas = [(peer, r) for peer, r in records.items()
                    if r.role in ("inference", "both") and peer in self.at_end]
        before = {peer: self.at_throttle.get(peer, 0) for peer, _ in replicas}
        after = {peer: self.at_end[peer] - before[peer] for peer, _ in replicas}

        def share(counts: dict[str, int], peer: str, stage: int) -> float:
            total = sum(n for p, n in counts.items() if records[p].stage == stage)
            return counts[peer] / total if total else 0.0
        return sorted((RoutingShare(
            name=r.name, stage=r.stage, throttled=peer in self.behind,
            before=before[peer], after=after[peer], share_before=share(before, peer, r.stage),
            share_after=share(after, peer, r.stage)) for peer, r in replicas),
            key=lambda s: (s.stage, s.name))
