"""Which new identities may get a session: one budget per stage for all of them, and the
operator's limits on who may serve at all.

Identities are free, so nothing granted per identity is a budget: a liar banned at its first
checked lie comes back under a new key. What a stage's replicas on probation (trust/reputation.py)
get is therefore counted per stage, for all of them together:

- The budget is a bucket of sessions. Every new session of the stage (to anyone) adds `share` to
  it, up to `burst`; a session given to a replica on probation takes 1. So while established
  replicas have room, all identities on probation of a stage together get at most `share` of its
  sessions, however many they are (net/directory.py `Directory.choose_inference` asks here).
  Where only replicas on probation have room, they serve (the run must go on) and the bucket is
  not charged.
- A replica banned while on probation empties its stage's bucket and halves the stage's refill
  for `ban_memory_s` (at most BANS_REMEMBERED halvings): a liar that takes a new key at each ban
  waits twice as long for each next session, so over N sessions of its stage it gets about
  log2(N) of them, not a share. An honest newcomer that joins right after pays the same wait:
  many keys are one attacker, and the swarm cannot tell which key is which.

What the operator may set on top (trust.admit_replicas, trust.probation_per_address):
- an allowlist: only replicas the operator admitted (RUN/admitted_replicas.txt) get sessions;
  any other is refused, counted and logged once;
- a per-address limit: at most `per_address` replicas on probation per host, the host as this
  node observed the peer's connection (net/daemon.py `Daemon.peer_hosts`, never an address the
  peer claims; a peer behind a relay is seen at the relay's host, and a peer this node holds no
  connection with counts under one shared "unseen" address). The first seen keep their place;
  later ones get nothing until one of them earns its record, leaves or is banned."""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from decentrl.config import TrustConfig

log = logging.getLogger(__name__)

# Halvings of a stage's refill that count at once: 2^-16 of the share is no session at all in a
# run's lifetime, so older bans add nothing (and the memory per stage is bounded).
BANS_REMEMBERED = 16
# Peers named once in the log as refused by the allowlist; the counter counts every refusal.
REFUSALS_LOGGED = 1024
# How long observed hosts are reused: asking the daemon for its connections at every session
# would cost a round trip to it per choice; a peer's host changes only when it reconnects.
HOSTS_FRESH_S = 10.0
UNSEEN = "unseen"


@dataclass
class ProbationBudget:
    share: float  # refill per session of the stage
    burst: float  # the most a stage's bucket holds
    ban_memory_s: float
    per_address: int = 0  # 0: no limit
    # Peer id -> the host this node observes its connection at (only asked with a limit).
    hosts: Callable[[], Mapping[str, str]] = lambda: {}
    clock: Callable[[], float] = time.monotonic
    tokens: dict[int, float] = field(default_factory=dict)  # by stage, full at first
    bans: dict[int, deque[float]] = field(default_factory=dict)  # by stage, clock times
    counts: Counter[str] = field(default_factory=Counter)
    refused_logged: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _hosts_at: float = float("-inf")
    _hosts: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, trust: TrustConfig) -> ProbationBudget:
        return cls(trust.probation_share, trust.probation_burst, trust.probation_ban_memory_s,
                   trust.probation_per_address)

    def refill_rate(self, stage: int) -> float:
        """What each session of `stage` adds to its bucket: `share`, halved per recent ban."""
        now = self.clock()
        recent = self.bans.get(stage, deque())
        while recent and now - recent[0] > self.ban_memory_s:
            recent.popleft()
        return self.share / 2 ** len(recent)

    def grant(self, stage: int, draw: float) -> bool:
        """Whether this new session of `stage` goes to a replica on probation (one has room and
        so has an established one): `draw` (uniform in [0, 1)) under `share` and a session in
        the bucket."""
        held = self._refilled(stage)
        if draw >= self.share:
            self.tokens[stage] = held
            return False
        if held < 1:  # drawn for a newcomer, but the stage's newcomers spent their budget
            self.tokens[stage] = held
            self.counts["probation_sessions_withheld"] += 1
            return False
        self.tokens[stage] = held - 1
        return True

    def served(self, stage: int) -> None:
        """A session of `stage` given with no choice between newcomers and established replicas:
        it refills the stage's bucket all the same."""
        self.tokens[stage] = self._refilled(stage)

    def _refilled(self, stage: int) -> float:
        return min(self.burst, self.tokens.get(stage, self.burst) + self.refill_rate(stage))

    def banned(self, stage: int) -> None:
        """A replica of `stage` was banned while on probation."""
        self.tokens[stage] = 0.0
        self.bans.setdefault(stage, deque(maxlen=BANS_REMEMBERED)).append(self.clock())

    def not_admitted(self, peer: str) -> None:
        """A replica the allowlist refused a session."""
        self.counts["replicas_not_admitted"] += 1
        if peer in self.refused_logged:
            return
        self.refused_logged[peer] = None
        if len(self.refused_logged) > REFUSALS_LOGGED:
            self.refused_logged.popitem(last=False)
        log.warning("replica %s gets no session: not admitted (trust.admit_replicas: only peers "
                    "listed in RUN/admitted_replicas.txt serve)", peer[-8:])

    def observe_hosts(self) -> None:
        """Ask where peers are connected from, if there is a limit and the last answer is old
        (outside the directory's lock: it is a round trip to the daemon)."""
        now = self.clock()
        if self.per_address and now - self._hosts_at > HOSTS_FRESH_S:
            self._hosts, self._hosts_at = dict(self.hosts()), now

    def over_address_limit(self, newcomers: Iterable[str]) -> set[str]:
        """Of `newcomers` (peers on probation, oldest first), those past `per_address` at their
        observed host (as `observe_hosts` last saw them)."""
        if not self.per_address:
            return set()
        seen: Counter[str] = Counter()
        over = set()
        for peer in newcomers:
            host = self._hosts.get(peer, UNSEEN)
            seen[host] += 1
            if seen[host] > self.per_address:
                over.add(peer)
        return over
