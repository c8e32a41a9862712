"""What the coordinator waits for from its stages: before a run starts, an inference replica and
an admitted, ready training peer at every stage (`stages_lacking`); during it, an inference
replica the run may use at every stage (`StageWait`: generation and evaluation hold, saying so,
until one joins or a ban ends, up to `swarm.stage_wait_s`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from rich.console import Console

from decentrl.net.directory import SwarmUnavailable
from decentrl.net.protocol import PeerRecord

log = logging.getLogger(__name__)

# While a stage has no inference replica, how often the console says so again.
STAGE_WAIT_REPORT_S = 30.0
# How often a wait for a stage's replica reads the DHT afresh.
STAGE_WAIT_LOOK_S = 1.0


def stages_lacking(stages: list[list[tuple[str, PeerRecord]]],
                   admitted: Callable[[str], bool]) -> list[str]:
    """What each stage still needs before a run can start, in words ("stage 1 has no training
    peer ready (1 loading)"); empty when every stage has what it needs. `stages`: each stage's
    (peer id, announcement)."""
    lacking = []
    for index, peers in enumerate(stages):
        needs = []
        if not any(r.role in ("inference", "both") for _, r in peers):
            needs.append("no inference replica")
        trainers = [(p, r) for p, r in peers if r.role in ("training", "both")]
        if not any(r.training_ready and admitted(p) for p, r in trainers):
            strangers = [p[-8:] for p, _ in trainers if not admitted(p)]
            loading = sum(admitted(p) and not r.training_ready for p, r in trainers)
            notes = ([f"{loading} loading"] if loading else []) + (
                [f"not admitted: {', '.join(strangers)}"] if strangers else [])
            needs.append("no admitted training peer ready"
                         + (f" ({'; '.join(notes)})" if notes else ""))
        if needs:
            lacking.append(f"stage {index} has {' and '.join(needs)}")
    return lacking


def unserved_stages(stages: list[list[tuple[str, PeerRecord]]],
                    distrusted: Callable[[str], bool]) -> list[str]:
    """The stages with no inference replica the run may use, in words ("stage 3 has no inference
    replica (1 banned)"); empty when every stage has one. `stages`: each stage's (peer id,
    announcement); `distrusted`: the trust gate's bans (a replica whose ban ended serves again).
    A replica merely avoided after a failed call still counts: sessions retry it."""
    lacking = []
    for index, peers in enumerate(stages):
        replicas = [peer for peer, record in peers if record.role in ("inference", "both")]
        if not any(not distrusted(peer) for peer in replicas):
            lacking.append(f"stage {index} has no inference replica"
                           + (f" ({len(replicas)} banned)" if replicas else ""))
    return lacking


class StageDirectory(Protocol):
    def refresh(self) -> None: ...
    def stage_peers(self) -> list[list[tuple[str, PeerRecord]]]: ...


class StageWait:
    """Waits until every stage has an inference replica the run may use (one joins, or a ban
    ends). Every thread that waits (generation loops, evaluation sessions) shares one wait: the
    console names what each stage lacks every STAGE_WAIT_REPORT_S, and SwarmUnavailable ends
    the wait `limit_s` after it began."""

    def __init__(self, directory: StageDirectory, distrusted: Callable[[str], bool],
                 limit_s: float, console: Console) -> None:
        self.directory, self.distrusted = directory, distrusted
        self.limit_s, self.console = limit_s, console
        self.lock = threading.Lock()
        self.since: float | None = None  # when the wait began; None: not waiting
        self.looked_at = self.reported_at = float("-inf")

    def unserved(self) -> list[str]:
        return unserved_stages(self.directory.stage_peers(), self.distrusted)

    def until_served(self, stop: threading.Event | None) -> None:
        """Return once every stage is served, or `stop` is set; raise SwarmUnavailable once
        the wait is `limit_s` old."""
        if not self.unserved():  # what the directory knows now: the cheap look, every round
            return
        while stop is None or not stop.is_set():
            with self.lock:
                now = time.monotonic()
                if now - self.looked_at >= STAGE_WAIT_LOOK_S:
                    self.looked_at = now
                    self.directory.refresh()
                lacking = self.unserved()
                if not lacking:
                    if self.since is not None:
                        self.console.print(f"[green]every stage has an inference replica again "
                                           f"after {now - self.since:.0f}s of waiting[/]")
                        self.since, self.reported_at = None, float("-inf")
                    return
                if self.since is None:
                    self.since = now
                waited = now - self.since
                if waited > self.limit_s:
                    raise SwarmUnavailable(f"after waiting {self.limit_s:.0f}s "
                                           f"(swarm.stage_wait_s), {'; '.join(lacking)}")
                if now - self.reported_at >= STAGE_WAIT_REPORT_S:
                    self.reported_at = now
                    text = (f"waiting for peers: {'; '.join(lacking)} ({waited:.0f}s of at most "
                            f"{self.limit_s:.0f}s)")
                    log.warning(text)
                    self.console.print(f"[yellow]{text}[/]")
            time.sleep(STAGE_WAIT_LOOK_S)
