"""The directory of a run's peers: every live announcement per stage, refreshed from the DHT,
with what this process learned of each peer (round-trip latency, open sessions, failures and bans)
and the routing choices made from it (which replica gets a session, which one verifies, which
training peer serves a stage)."""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from decentrl.config import SwarmConfig
from decentrl.errors import DecentrlError
from decentrl.net.node import SwarmNode
from decentrl.net.probation import ProbationBudget
from decentrl.net.protocol import PeerRecord, stage_key
from decentrl.net.records import decode_records
from decentrl.net.text import peer_text

log = logging.getLogger(__name__)

# Peers kept per stage. Anyone can announce under a stage's key, and each one kept has its
# routing state; a stage of a volunteer swarm has tens of replicas. Every announcement found is
# decoded first (the DHT keeps at most net/dht_storage.py's STAGE_WRITERS per key, each within
# PEER_RECORD_BYTES), so malformed ones take no place. Past the cap, peers already in the
# directory keep up to all but NEWCOMER_PLACES of the places (drawn at random when more are
# known) and newcomers are drawn at random for the rest: a crowd of identities that announced
# first cannot keep a replica that comes later out, nor push out the peers already known.
PEERS_PER_STAGE = 256
NEWCOMER_PLACES = PEERS_PER_STAGE // 4
# Peers whose session counts are kept (identities are free: bounded; a swarm has tens).
OPENED_KEPT = 1024


class SwarmUnavailable(DecentrlError, RuntimeError):
    """No live peer could do the work after every retry; the caller decides what to do."""


@dataclass
class PeerState:
    record: PeerRecord
    latency_s: float = 0.1  # smoothed round trip of this process's calls
    sessions: int = 0  # sessions this process has open on the peer
    banned_until: float = 0.0
    failures: int = 0


@dataclass
class Directory:
    """Live peers per stage, refreshed from the DHT, plus what this process learned of them."""

    node: SwarmNode
    run: str
    num_stages: int
    swarm: SwarmConfig
    peers: dict[str, PeerState] = field(default_factory=dict)
    opened: OrderedDict[str, int] = field(default_factory=OrderedDict)  # sessions given, by peer
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Peers the run's reputation banned (trust/reputation.py): never chosen, not even as a last
    # resort, unlike peers merely avoided after a failure.
    distrusted: Callable[[str], bool] = lambda peer: False
    # Peers still earning a record (trust/reputation.py), and what all of a stage's get while
    # an established replica has room (net/probation.py; no limit by default).
    on_probation: Callable[[str], bool] = lambda peer: False
    probation: ProbationBudget = field(default_factory=lambda: ProbationBudget(1.0, 1.0, 0.0))
    # Replicas the operator lets serve (trust.admit_replicas); any other gets no session.
    replica_admitted: Callable[[str], bool] = lambda peer: True
    random: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))
    # The newest version a replica of a stage can serve (its trainer's), where the caller knows
    # it; None: unknown.
    version_ceiling: Callable[[int], int | None] = lambda stage: None
    # Called with (peer id, its record, True) for each peer that appeared and (.., False) for
    # each whose announcement expired, after a refresh, outside the lock.
    on_change: Callable[[str, PeerRecord, bool], None] = lambda peer, record, joined: None
    # Validly signed announcements whose body was malformed (or of another stage), once per
    # refresh that met each: anyone may write under a stage's key.
    skipped_records: int = 0

    def refresh(self) -> None:
        found: dict[str, PeerRecord] = {}
        skipped = 0
        for stage in range(self.num_stages):
            entries = self.node.run(self.node.lookup(stage_key(self.run, stage)),
                                    timeout=self.swarm.request_timeout_s)
            records, skipped_here = decode_records(entries, PeerRecord, stage)
            found.update(self._keep(stage, records))
            skipped += skipped_here
        with self.lock:
            self.skipped_records += skipped
            joined = [(peer, record) for peer, record in found.items() if peer not in self.peers]
            left = [(peer, self.peers.pop(peer).record) for peer in set(self.peers) - set(found)]
            for peer, record in found.items():
                state = self.peers.setdefault(peer, PeerState(record))
                state.record = record
        for peer, record in joined:
            self.on_change(peer, record, True)
        for peer, record in left:
            self.on_change(peer, record, False)

    def _keep(self, stage: int, records: dict[str, PeerRecord]) -> dict[str, PeerRecord]:
        """Of a stage's well-formed announcements, the PEERS_PER_STAGE kept (see there)."""
        if len(records) <= PEERS_PER_STAGE:
            return records
        with self.lock:
            known = [peer for peer in records if peer in self.peers]
        newcomers = [peer for peer in records if peer not in self.peers]
        # Newcomers get NEWCOMER_PLACES at least, known peers every place newcomers leave.
        known_places = max(PEERS_PER_STAGE - NEWCOMER_PLACES, PEERS_PER_STAGE - len(newcomers))
        kept_known = self.random.sample(known, min(len(known), known_places))
        drawn = self.random.sample(newcomers,
                                   min(len(newcomers), PEERS_PER_STAGE - len(kept_known)))
        log.warning("stage %d: %d announcements, keeping %d of %d known peers and %d of %d "
                    "newcomers", stage, len(records), len(kept_known), len(known), len(drawn),
                    len(newcomers))
        kept = kept_known + drawn
        return {peer: records[peer] for peer in kept}

    def _live(self, stage: int) -> list[tuple[str, PeerState]]:
        now = time.monotonic()
        return [(peer, s) for peer, s in self.peers.items()
                if s.record.stage == stage and s.banned_until <= now
                and not self.distrusted(peer)]

    def choose_inference(self, stage: int, allow_banned: bool = False,
                         avoid: frozenset[str] = frozenset()) -> str | None:
        """A replica for a new session: the newest weights (fresher rollouts), then the fewest
        sessions this process has open there, then the lowest latency. With `allow_banned`, when
        every replica of the stage is banned, the one whose ban ends first: a peer that failed
        once is better than no peer.

        What a peer announces of itself only limits it: its free sessions cap what it gets (a
        peer that claims a huge capacity gets no bigger share), and a version over
        `version_ceiling` (the newest the stage's trainer has made) is a lie, ranked below every
        other. Peers on probation (`on_probation`) share one budget per stage while an
        established replica has room (`probation`: net/probation.py), so neither a burst of
        new identities nor one liar renewing its key can take over generation; a replica the
        operator did not admit (`replica_admitted`), or one on probation past its address's
        limit, gets nothing. `avoid`: peers the session asking has lost already (by another
        peer's account: a claim, not this process's own observation), taken only as a last
        resort (`allow_banned`) when nobody else has room."""
        self.probation.observe_hosts()
        with self.lock:
            replicas = self._with_room(stage)
            fresh = [r for r in replicas if r[0] not in avoid]
            replicas = fresh if fresh or not allow_banned else replicas
            if not replicas:
                return None
            now = time.monotonic()
            candidates = [(p, s) for p, s in replicas if s.banned_until <= now]
            if not candidates:
                if not allow_banned:
                    return None
                candidates = [min(replicas, key=lambda item: item[1].banned_until)]
            new = {p for p, _ in candidates if self.on_probation(p)}
            if 0 < len(new) < len(candidates):
                chose_new = self.probation.grant(stage, self.random.random())
                candidates = [(p, s) for p, s in candidates if (p in new) == chose_new]
            else:
                self.probation.served(stage)
            ceiling = self.version_ceiling(stage)
            versions = {p: -1 if ceiling is not None and s.record.version > ceiling
                        else s.record.version for p, s in candidates}
            newest = max(versions.values())
            peer, state = min(candidates, key=lambda item: (
                newest - versions[item[0]], item[1].sessions, item[1].latency_s))
            state.sessions += 1
            # Kept when the peer drops out of the directory (an announcement late) and returns.
            self.opened[peer] = self.opened.get(peer, 0) + 1
            self.opened.move_to_end(peer)
            while len(self.opened) > OPENED_KEPT:
                self.opened.popitem(last=False)
            return peer

    def _with_room(self, stage: int) -> list[tuple[str, PeerState]]:
        """The stage's inference replicas that the run has not banned, that the operator admits,
        within their address's limit of peers on probation, and that say they have room for
        another session of this process (under the lock)."""
        replicas = [(p, s) for p, s in self.peers.items()
                    if s.record.stage == stage and s.record.role in ("inference", "both")
                    and s.record.free_sessions - s.sessions > 0 and not self.distrusted(p)
                    and self._admitted(p)]
        return self._within_address_limit(replicas)

    def routed(self, stage: int) -> list[tuple[str, PeerRecord]]:
        """The replicas a new session of `stage` may go to now (`choose_inference`'s candidates):
        with room, neither banned by the run nor avoided after a failed call."""
        now = time.monotonic()
        with self.lock:
            return [(p, s.record) for p, s in self._with_room(stage) if s.banned_until <= now]

    def verifiers(self, stage: int, exclude: set[str]) -> list[str]:
        """Every peer that can re-execute someone else's work at `stage`: replicas that follow
        the stage's weights (they can rewind them) and training peers that keep a copy of what
        those replicas serve (`PeerRecord.verifies`), live, not banned, none of `exclude`. Who
        among them judges is the caller's (random) choice, never what they announce."""
        now = time.monotonic()
        with self.lock:
            return [p for p, s in self.peers.items()
                    if s.record.stage == stage
                    and (s.record.role == "inference" or s.record.verifies)
                    and p not in exclude and s.banned_until <= now and not self.distrusted(p)
                    and (s.record.role != "inference" or self.replica_admitted(p))]

    def probation_banned(self, peer: str) -> None:
        """`peer` was banned while on probation: its stage's newcomers wait longer
        (net/probation.py)."""
        with self.lock:
            state = self.peers.get(peer)
            if state is not None:
                self.probation.banned(state.record.stage)

    def _admitted(self, peer: str) -> bool:
        """Whether the operator lets `peer` serve; a refusal is counted and logged once."""
        if self.replica_admitted(peer):
            return True
        self.probation.not_admitted(peer)
        return False

    def _within_address_limit(self, replicas: list[tuple[str, PeerState]]
                              ) -> list[tuple[str, PeerState]]:
        """`replicas` less the peers on probation past their observed address's limit, counted
        over every stage's live newcomers, the first seen first (under the lock)."""
        newcomers = (p for p, s in self.peers.items()
                     if s.record.role != "training" and not self.distrusted(p)
                     and self.on_probation(p))
        over = self.probation.over_address_limit(newcomers)
        if not over:
            return replicas
        kept = [(p, s) for p, s in replicas if p not in over]
        self.probation.counts["probation_address_limited"] += len(replicas) - len(kept)
        return kept

    def release(self, peer: str) -> None:
        with self.lock:
            if peer in self.peers:
                self.peers[peer].sessions = max(0, self.peers[peer].sessions - 1)

    def training_peer(self, stage: int, admitted: Callable[[str], bool]
                      ) -> tuple[str, PeerRecord] | None:
        """The stage's training peer: an `admitted` one that says it is ready (the newest
        version first). Anyone can announce itself as a training peer; only the run's owner
        admits one."""
        ready = self.training_peers(stage, admitted)
        return max(ready, key=lambda item: item[1].version) if ready else None

    def training_peers(self, stage: int, admitted: Callable[[str], bool]
                       ) -> list[tuple[str, PeerRecord]]:
        """The stage's `admitted` training peers that say they are ready and are not banned."""
        with self.lock:
            return [(p, s.record) for p, s in self._live(stage)
                    if s.record.training_ready and admitted(p)]

    def observe(self, peer: str, seconds: float) -> None:
        with self.lock:
            state = self.peers.get(peer)
            if state is not None:
                state.latency_s = 0.8 * state.latency_s + 0.2 * seconds
                state.failures = 0

    def ban(self, peer: str, reason: str) -> None:
        with self.lock:
            state = self.peers.get(peer)
            if state is None:
                return
            state.failures += 1
            state.banned_until = time.monotonic() + self.swarm.avoid_failed_peer_s
        log.warning("peer %s avoided for %.0fs: %s", peer[-8:], self.swarm.avoid_failed_peer_s,
                    peer_text(reason))

    def records(self) -> dict[str, PeerRecord]:
        """Every live announcement, by peer id."""
        with self.lock:
            return {peer: s.record for peer, s in self.peers.items()}

    def sessions_opened(self) -> dict[str, int]:
        """By peer id, the sessions this process has given each peer so far (the OPENED_KEPT
        most recently given one)."""
        with self.lock:
            return dict(self.opened)

    def stage_peers(self) -> list[list[tuple[str, PeerRecord]]]:
        """Each stage's (peer id, announcement)."""
        with self.lock:
            return [[(p, s.record) for p, s in self.peers.items() if s.record.stage == stage]
                    for stage in range(self.num_stages)]

    def stage_summary(self) -> list[list[PeerRecord]]:
        """Each stage's announcements."""
        return [[record for _, record in peers] for peers in self.stage_peers()]


def backoff(attempt: int) -> float:
    """Exponential with jitter, capped: 0.2 s, 0.4 s, 0.8 s ... 5 s."""
    return min(5.0, 0.2 * 2 ** attempt) * (0.5 + random.random())
