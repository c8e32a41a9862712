"""Reputation: every peer's score from what the coordinator learned of it, and bans.

A peer's score is (1 + passed) / (1 + passed + failed), where `failed` weighs each bad event by
how sure the evidence is: a spot-check that re-executed its work and found a lie counts 1, a
signed claim that contradicts what it delivered (proof) counts enough to ban at once, a flag from
the trainer's log-probs (strong but indirect evidence) counts 0.5, a malformed message 0.25. A new
peer starts at 1; an honest peer's rare false alarm costs little once it has passed a few checks.
Below `ban_score` the peer is banned for `ban_s`, doubled at each later ban; when a ban ends the
peer starts over (score 1) on probation: the next ban is longer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

Outcome = Literal["passed", "failed", "proved", "flagged", "malformed"]
# How much one event of each kind counts against a peer (see the module docstring).
FAILURE_WEIGHTS: dict[Outcome, float] = {"failed": 1.0, "proved": 100.0, "flagged": 0.5,
                                         "malformed": 0.25}


@dataclass(frozen=True)
class TrustEvent:
    time: float  # wall clock
    peer: str
    stage: int | None  # None: not about a stage's work (a submission, a malformed message)
    outcome: Outcome
    detail: str


@dataclass
class PeerStanding:
    passed: int = 0
    failed: float = 0.0
    bans: int = 0
    banned_until: float = 0.0  # monotonic

    @property
    def score(self) -> float:
        return (1 + self.passed) / (1 + self.passed + self.failed)


@dataclass
class Reputation:
    ban_score: float
    ban_s: float
    on_ban: list[Callable[[str, float], None]] = field(default_factory=list)  # (peer, seconds)
    clock: Callable[[], float] = time.monotonic
    standings: dict[str, PeerStanding] = field(default_factory=dict)
    events: list[TrustEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, peer: str, outcome: Outcome, detail: str = "",
               stage: int | None = None) -> bool:
        """Count one event; True if it got the peer banned just now."""
        with self.lock:
            standing = self.standings.setdefault(peer, PeerStanding())
            now = self.clock()
            if standing.banned_until and standing.banned_until <= now:
                # The ban is over: a fresh start, on probation (the next ban is longer).
                standing.passed, standing.failed, standing.banned_until = 0, 0.0, 0.0
            if outcome == "passed":
                standing.passed += 1
            else:
                standing.failed += FAILURE_WEIGHTS[outcome]
            self.events.append(TrustEvent(time.time(), peer, stage, outcome, detail))
            newly_banned = standing.banned_until <= now and standing.score < self.ban_score
            if newly_banned:
                seconds = self.ban_s * 2 ** standing.bans
                standing.bans += 1
                standing.banned_until = now + seconds
        if outcome != "passed":
            log.warning("peer %s %s%s: %s (score %.2f)", peer[-8:], outcome,
                        "" if stage is None else f" at stage {stage}", detail, standing.score)
        if newly_banned:
            log.warning("peer %s banned for %.0fs (score %.2f < %.2f)", peer[-8:], seconds,
                        standing.score, self.ban_score)
            for callback in self.on_ban:
                callback(peer, seconds)
        return newly_banned

    def score(self, peer: str) -> float:
        with self.lock:
            standing = self.standings.get(peer)
            return 1.0 if standing is None else standing.score

    def banned(self, peer: str) -> bool:
        with self.lock:
            standing = self.standings.get(peer)
            return standing is not None and standing.banned_until > self.clock()

    def counts(self, peer: str) -> dict[str, int]:
        """How many events of each outcome the peer has had (for reports and tests)."""
        with self.lock:
            found: dict[str, int] = {}
            for event in self.events:
                if event.peer == peer:
                    found[event.outcome] = found.get(event.outcome, 0) + 1
            return found
