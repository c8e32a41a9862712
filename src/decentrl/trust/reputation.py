"""Reputation: every peer's score from what the coordinator learned of it, and bans.

A peer's score is (1 + passed) / (1 + passed + failed), where `failed` weighs each bad event by
how sure the evidence is: a spot-check that re-executed its work and found a lie counts 1, a
signed claim that contradicts what it delivered (proof) counts enough to ban at once, a flag from
the trainer's log-probs (strong but indirect evidence) counts 0.5, a malformed message 0.25. A new
peer starts at 1; an honest peer's rare false alarm costs little once it has passed a few checks.
Below `ban_score` the peer is banned for `ban_s`, doubled at each later ban; when a ban ends the
peer starts over (score 1): the next ban is longer.

Identities are free, so a score that starts at 1 would let a liar that rotates its key serve at
full trust forever. A peer is on probation until it has passed `probation_checks` checks as a
producer. While it is:
- its groups are checked at a higher rate, each with a second opinion (trust/gate.py), and a
  group of it that cannot be checked never trains;
- its opinion as a verifier decides nothing (trust/tribunal.py): it never confirms a failure,
  never outvotes or overrules anyone, and never clears a group or earns a producer a pass; it
  may only make the tribunal ask an established verifier, and where none is left the check is
  skipped or its group dropped, charging nobody, and counted;
- it shares its stage's probation budget of new sessions with every other peer on probation
  (net/probation.py), and a ban of it shrinks that budget for all of them;
- a single confirmed lie (`failed` or `proved`), as producer or as verifier, bans it.
Peers the operator admitted start with a record: training peers listed in RUN/admitted.txt
(`vouched`: the tribunal also lets one's opinion stand alone where nobody else can be asked) and,
with trust.admit_replicas, inference replicas listed in RUN/admitted_replicas.txt (`admitted`).

Everything kept here grows with what strangers send (one malformed message from a fresh identity
is an event and a standing), so every table is bounded: the events, the standings, the causes of
bans, and each event's detail (often the peer's own error text, made inert by net/text.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

from decentrl.net.text import peer_text

log = logging.getLogger(__name__)

Outcome = Literal["passed", "failed", "proved", "flagged", "malformed"]
# How much one event of each kind counts against a peer (see the module docstring).
FAILURE_WEIGHTS: dict[Outcome, float] = {"failed": 1.0, "proved": 100.0, "flagged": 0.5,
                                         "malformed": 0.25}
# Events held for the swarm observer, which writes the new ones to metrics.jsonl at every snapshot
# (swarm.snapshot_every_s, 10 s by default): an honest swarm causes a few spot-check events a
# second at most. Past this the oldest go unwritten, and the observer says how many.
EVENTS_KEPT = 1024
# Peers with a standing. An honest swarm has tens; a stranger gets one with its first event and
# identities are free, so this bounds memory, not the attack: a forgotten peer starts over at
# score 1, as a fresh identity would. The least recently seen peer not under a ban goes first.
STANDINGS_KEPT = 4096
# Bans whose cause the run's summary explains: the first few tell the story, a flood of banned
# throwaway identities only repeats it (every ban is counted and logged).
BANS_EXPLAINED = 64
# An event's detail, often the peer's own error text: enough for a reason and its context.
DETAIL_CHARS = 300


@dataclass(frozen=True)
class TrustEvent:
    time: float  # wall clock
    peer: str
    stage: int | None  # None: not about a stage's work (a submission, a malformed message)
    outcome: Outcome
    detail: str


@dataclass
class PeerStanding:
    passed: int = 0  # as a producer
    failed: float = 0.0
    upheld: int = 0  # as a verifier
    overruled: float = 0.0
    bans: int = 0
    banned_until: float = 0.0  # monotonic
    outcomes: Counter[Outcome] = field(default_factory=Counter)  # events of each kind, ever

    @property
    def score(self) -> float:
        return min((1 + self.passed) / (1 + self.passed + self.failed),
                   (1 + self.upheld) / (1 + self.upheld + self.overruled))


@dataclass
class Reputation:
    ban_score: float
    ban_s: float
    probation_checks: int = 0
    # Peers with a record from the start (the operator admitted them), read afresh at each look:
    # training peers (`vouched`, trusted with a stage's gradients) and inference replicas.
    vouched: Callable[[str], bool] = lambda peer: False
    admitted: Callable[[str], bool] = lambda peer: False
    on_ban: list[Callable[[str, float], None]] = field(default_factory=list)  # (peer, seconds)
    clock: Callable[[], float] = time.monotonic
    # Least recently seen first.
    standings: OrderedDict[str, PeerStanding] = field(default_factory=OrderedDict)
    # The newest EVENTS_KEPT events, of `events_recorded` in all.
    events: deque[TrustEvent] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    events_recorded: int = 0
    # Peer -> the event that caused its first ban, for the first BANS_EXPLAINED peers banned.
    ban_causes: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, peer: str, outcome: Outcome, detail: str = "",
               stage: int | None = None, as_verifier: bool = False) -> bool:
        """Count one event (of the peer's work as a verifier with `as_verifier`); True if it
        got the peer banned just now."""
        detail = peer_text(detail, DETAIL_CHARS)
        with self.lock:
            now = self.clock()
            standing = self._standing(peer, now)
            if standing.banned_until and standing.banned_until <= now:
                # The ban is over: a fresh start, on probation (the next ban is longer).
                standing.passed, standing.failed, standing.banned_until = 0, 0.0, 0.0
                standing.upheld, standing.overruled = 0, 0.0
            on_probation = self._on_probation(peer, standing)
            if as_verifier:
                if outcome == "passed":
                    standing.upheld += 1
                else:
                    standing.overruled += FAILURE_WEIGHTS[outcome]
            elif outcome == "passed":
                standing.passed += 1
            else:
                standing.failed += FAILURE_WEIGHTS[outcome]
            standing.outcomes[outcome] += 1
            self.events.append(TrustEvent(time.time(), peer, stage, outcome, detail))
            self.events_recorded += 1
            lied_on_probation = on_probation and outcome in ("failed", "proved")
            newly_banned = standing.banned_until <= now and (
                standing.score < self.ban_score or lied_on_probation)
            if newly_banned:
                seconds = self.ban_s * 2 ** standing.bans
                standing.bans += 1
                standing.banned_until = now + seconds
                if peer not in self.ban_causes and len(self.ban_causes) < BANS_EXPLAINED:
                    where = "" if stage is None else f" at stage {stage}"
                    self.ban_causes[peer] = f"{outcome}{where}: {detail}"
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

    def on_probation(self, peer: str) -> bool:
        """Whether `peer` has yet to earn a record (see the module docstring)."""
        with self.lock:
            return self._on_probation(peer, self.standings.get(peer))

    def _on_probation(self, peer: str, standing: PeerStanding | None) -> bool:
        passed = 0 if standing is None else standing.passed
        return (passed < self.probation_checks and not self.vouched(peer)
                and not self.admitted(peer))

    def banned(self, peer: str) -> bool:
        with self.lock:
            standing = self.standings.get(peer)
            return standing is not None and standing.banned_until > self.clock()

    def counts(self, peer: str) -> dict[str, int]:
        """How many events of each outcome the peer has had while its standing was kept (for
        reports and tests)."""
        with self.lock:
            standing = self.standings.get(peer)
            return {} if standing is None else dict(standing.outcomes)

    def events_after(self, seen: int) -> tuple[list[TrustEvent], int]:
        """The events recorded after the first `seen` that are still held (the oldest of them
        may be gone: see EVENTS_KEPT), and how many have been recorded in all."""
        with self.lock:
            held = min(self.events_recorded - seen, len(self.events))
            return list(islice(self.events, len(self.events) - held, None)), self.events_recorded

    def _standing(self, peer: str, now: float) -> PeerStanding:
        """`peer`'s standing, now its most recently seen; a new one may push the least recently
        seen peer not under a ban (or, when every peer is, the least recently seen) out."""
        standing = self.standings.get(peer)
        if standing is not None:
            self.standings.move_to_end(peer)
            return standing
        if len(self.standings) >= STANDINGS_KEPT:
            unbanned = (p for p, s in self.standings.items() if s.banned_until <= now)
            del self.standings[next(unbanned, next(iter(self.standings)))]
        standing = self.standings[peer] = PeerStanding()
        return standing
