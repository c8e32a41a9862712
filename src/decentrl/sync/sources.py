"""Whom a replica asks for each chunk of a weight update (sync/distribute.py), and whom it avoids.

Chunks spread like a swarm: the announced replicas of a stage, sorted by peer id, each own every
n-th chunk. But anyone can announce a replica, so an announcement alone earns a peer no wait: a
record naming a peer that never answers would hold every follower on each of its chunks until
the request times out (bench unchecked-claims on the code before this module: 44 s an update
instead of 0.05 s, with one such record on loopback). A follower
therefore keeps its own record of its sources:

- `served`: peers that served it a chunk whose hash matched, and when. An owner served lately
  is asked with the full timeout; it holds the request open while it fetches the chunk itself.
  The chunks of an owner not served lately come from the publisher at once.
- probes: once an update is in hand, the follower asks a few unproven owners (at most
  PROBES_PER_UPDATE, chosen at random, so ground peer ids buy no place) for one chunk of it each,
  with a short timeout, off the update's path. One that serves it well is waited on from the
  next update on: an honest replica that joins costs the publisher one extra copy of an update.
- `avoided`: sources that did not answer in time (or could not be dialed) are not asked again
  for BACKOFF_S; sources that served a chunk whose hash did not match, for `ban_s`.

The publisher, named by the run owner's signed lineage, is every chunk's last resort; each chunk
it serves because the owner was passed over or failed counts in `fallbacks`."""

from __future__ import annotations

import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Proven sources remembered. A stage has tens of replicas; more than this and the longest idle is
# forgotten (it is probed again when it owns a chunk).
SERVED_KEPT = 256
# A source that served nothing good for this long is unproven again: replicas come and go, and
# one proven long ago may be gone or hold a request open now (updates come every few seconds to
# minutes, so a live replica keeps its standing).
SERVED_LIFETIME_S = 600.0
# Sources avoided after a timeout or a bad chunk, remembered. Identities are free, so the table is
# bounded; the entry avoided longest ago goes first.
AVOIDED_KEPT = 1024
# How long a source that did not answer in time is not asked: a few updates, long enough that a
# dead record costs one probe per minute at most, short enough that a peer back from a hiccup
# serves again soon.
BACKOFF_S = 60.0
# Unproven owners probed per update, in parallel, off the update's path: a flood of fake records
# costs a follower a few short requests per update, and a stage's honest replicas get proven a
# few per update.
PROBES_PER_UPDATE = 4
# A probe's time to answer beyond the time the owner may hold the request (`chunk_wait_s`): one
# round trip and a chunk of at most 2 MiB over a consumer uplink.
PROBE_ANSWER_S = 3.0


@dataclass(frozen=True)
class Source:
    """One peer to ask for a chunk, and how long to wait for it."""

    peer: str
    timeout_s: float


@dataclass
class ChunkSources:
    """A follower's view of where chunks come from; see the module's docstring. Not thread-safe:
    it lives on the node's event loop, as the follower does."""

    timeout_s: float  # the full wait for a proven owner or the publisher (hold included)
    chunk_wait_s: float  # how long an owner may hold a request for a chunk it still fetches
    ban_s: float  # how long a source of a bad chunk is avoided
    clock: Callable[[], float] = time.monotonic
    random: random.Random = field(default_factory=lambda: random.Random(secrets.randbits(64)))
    served: OrderedDict[str, float] = field(default_factory=OrderedDict)  # peer: last good chunk
    # Peer: until when it is not asked. One table for both reasons (a timeout, a bad chunk), so
    # that one bound covers them.
    avoided: OrderedDict[str, float] = field(default_factory=OrderedDict)
    fallbacks: int = 0  # chunks asked of the publisher because their owner was passed over
    unanswered: int = 0  # requests to a source that timed out or could not be dialed
    bad_chunks: int = 0

    def avoids(self, peer: str) -> bool:
        return self.avoided.get(peer, 0.0) > self.clock()

    def proven(self, peer: str) -> bool:
        last = self.served.get(peer)
        return last is not None and self.clock() - last <= SERVED_LIFETIME_S

    def owners(self, announced: Sequence[str], me: str) -> list[str]:
        """The rotation of chunk owners for one update: the announced replicas this follower does
        not avoid, and itself, sorted by peer id (honest followers, reading the same
        announcements, agree on it: a chunk's owner fetches it from the publisher itself)."""
        return sorted({me} | {peer for peer in announced if not self.avoids(peer)})

    def probes(self, owners: Sequence[str], me: str) -> list[Source]:
        """The unproven owners to ask for a chunk once an update is in hand (PROBES_PER_UPDATE
        at most, at random), each with the short timeout of a probe."""
        unproven = [peer for peer in owners if peer != me and not self.proven(peer)]
        timeout_s = min(self.timeout_s, self.chunk_wait_s + PROBE_ANSWER_S)
        return [Source(peer, timeout_s) for peer in
                self.random.sample(unproven, min(PROBES_PER_UPDATE, len(unproven)))]

    def for_chunk(self, owner: str, me: str, publisher: str, relayed: bool) -> list[Source]:
        """Whom to ask for one chunk `owner` owns, in order: the owner if it has earned the wait,
        then the publisher."""
        last_resort = Source(publisher, self.timeout_s)
        if owner == me or relayed:
            return [last_resort]
        if self.proven(owner):
            return [Source(owner, self.timeout_s), last_resort]
        self.fallbacks += 1
        return [last_resort]

    def good_chunk(self, peer: str) -> None:
        self.served[peer] = self.clock()
        self.served.move_to_end(peer)
        while len(self.served) > SERVED_KEPT:
            self.served.popitem(last=False)

    def no_answer(self, peer: str, publisher: str) -> None:
        """`peer` did not answer a chunk request in time, or could not be dialed: back off (the
        publisher excepted, the only source the run owner vouches for)."""
        self.unanswered += 1
        if peer != publisher:
            self.served.pop(peer, None)
            self._avoid(peer, BACKOFF_S)

    def bad_chunk(self, peer: str) -> None:
        """`peer` served a chunk whose hash did not match: banned for `ban_s`."""
        self.bad_chunks += 1
        self.served.pop(peer, None)
        self._avoid(peer, self.ban_s)

    def fell_back(self) -> None:
        """A chunk's owner was asked and failed: the publisher serves it."""
        self.fallbacks += 1

    def _avoid(self, peer: str, seconds: float) -> None:
        """Avoid `peer` for `seconds` from now, or longer if it already is."""
        until = max(self.avoided.pop(peer, 0.0), self.clock() + seconds)
        self.avoided[peer] = until
        while len(self.avoided) > AVOIDED_KEPT:
            self.avoided.popitem(last=False)
