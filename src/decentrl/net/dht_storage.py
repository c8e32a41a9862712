"""What a node keeps for others in the DHT: only its run's keys, each kind of record within its
real size, for a few announce periods, within a byte budget per writer, per key and in total.

Hivemind's storage keeps any key, any number of writers per key, any size up to the record cap
and any expiry: one stranger could fill a node's memory with records kept for years, and a crowd
of throwaway identities could grow a stage's key past what one DHT reply carries, so that nobody
could read the stage any more. `BoundedDHTStorage` replaces the storage of the node's `DHTNode`
(net/daemon.py): every record that a peer asks this node to store, and every record of its own,
goes through `store_subkey`, which refuses (and counts by reason) before anything is kept:

- a key outside this node's run (`RunNamespace`: the run's name, its owner and its stages) or a
  record a key's kind does not take from its writer (the owner's keys take the owner's record
  only, a route key or an offer key its peer's: those two a node keeps whatever run it joined,
  if any);
- an expiry past `MAX_RECORD_TTL_S` from now (or a few of the run's announce periods);
- a body over its kind's size (`KeyKind.max_body_bytes`);
- a writer over `MAX_WRITER_BYTES` (the owner: one record per key of its run), a key over its
  kind's writers or `MAX_KEY_BYTES`, the store over `MAX_STORED_BYTES`.

A node learns its run when it takes a part in it: a stage peer from the config it serves
(stage/peer.py `StagePeer.start`), the owner when it publishes the run's manifest
(coordinator/manifest.py). Until then (a joiner waiting for the manifest, a relay, a bootstrap
node) it keeps peers' own route records and offers only: it serves nobody in a run yet, and the
run's nodes keep the run's records.

A record already kept stays until it expires; its writer may renew it (a new body of the same
kind replaces the old one) while every budget still holds. A key's first writers keep their
places: a crowd that arrives later is refused, never let in by evicting them. What this does not
hold against: more than STAGE_WRITERS identities that fill a stage's key at a node before a
replica announces itself keep that replica's record off that node for as long as they renew
theirs (other nodes keep it where they have room, and the directory draws fairly among what it
reads, net/directory.py); identities cost nothing here.

The DHT's cache (records pushed "in_cache", and replies cached on the way) serves no lookup of
ours (every lookup asks for the latest records, which a cache cannot be sure to hold), so the
node keeps none (`NoCache`) and refuses them all."""

from __future__ import annotations

import heapq
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from hivemind.dht.routing import DHTID, BinaryDHTValue, Subkey
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import (
    MAX_DHT_TIME_DISCREPANCY_SECONDS,
    DHTExpiration,
    get_dht_time,
)

from decentrl.config import RunConfig
from decentrl.errors import DecentrlError
from decentrl.net.protocol import coordinator_key, ended_key, lineage_key, offer_key, stage_key
from decentrl.net.reach import MAX_ADDRESS_CHARS, MAX_ROUTES, route_key
from decentrl.net.records import MAX_RECORD_BYTES, stored_value_bytes

log = logging.getLogger(__name__)

# The longest a record may be kept, unless its run announces more slowly (below). A record lives
# until its writer renews it or goes away: peers renew every `announce_every_s` (2 s by default)
# with 5 periods of life, route records every 20 s with 60 s of life (net/dialback.py), and the
# owner's word that its run ended must outlive the peers' 10 s between checks
# (launch/join.py RUN_END_CHECK_S). Two minutes covers them all, and makes everything a stranger
# stored vanish two minutes after it stops writing.
MAX_RECORD_TTL_S = 120.0
# A run that announces every `announce_every_s` keeps its records up to this many periods: the
# 5 periods of life its peers give their announcements, and one for a late renewal.
RECORD_LIFE_PERIODS = 6
# An announcement (`PeerRecord`) is ~330 bytes with a 40-character name: room for a name of a
# kilobyte and fields to come.
PEER_RECORD_BYTES = 2 * 2**10
# A route record lists at most MAX_ROUTES addresses of MAX_ADDRESS_CHARS (net/reach.py), each
# with its msgpack header, plus the list's and the struct's framing.
ROUTE_RECORD_BYTES = MAX_ROUTES * (MAX_ADDRESS_CHARS + 3) + 64
# The owner's word that the run ended: the run's name and step count, with room for a session.
RUN_END_BYTES = 2**10
# A training peer's offer to a planning owner (HostOffer): a run name, a role and two numbers.
OFFER_BYTES = 2**10
# Writers kept under one stage key: twice the directory's PEERS_PER_STAGE (net/directory.py), so
# a stage of a volunteer swarm (tens of replicas) fits many times over.
STAGE_WRITERS = 512
# Each kept record also costs its subkey (the writer's peer id), its expiry and its framing in
# memory and in every reply that carries it.
ENTRY_OVERHEAD_BYTES = 32
# Hivemind's DHT replies travel as one message capped at 4 MiB by the p2p daemon, and an oversized
# reply is lost (see FindReplyBound): one key always fits in a reply with room to spare, and a
# request for several keys is answered only while the keys fit together.
MAX_KEY_BYTES = 2 * 2**20
MAX_FIND_REPLY_BYTES = 3 * 2**20
# All a node keeps for others: a thousand-peer swarm's announcements and routes take ~5 MiB, and
# a node keeps only the keys nearest to it.
MAX_STORED_BYTES = 32 * 2**20

StorageRefusal = Literal["no subkey", "outside this node's run", "not its writer's key",
                         "expiry too far", "over its kind's size", "writer over its budget",
                         "key full", "storage full", "cache"]


@dataclass(frozen=True)
class KeyKind:
    """What one kind of key holds: records of at most `max_body_bytes` from at most
    `max_writers` writers (the run's owner only, where `owner_only`)."""

    name: str
    max_body_bytes: int
    max_writers: int = 1
    owner_only: bool = False


STAGE = KeyKind("stage", PEER_RECORD_BYTES, STAGE_WRITERS)
MANIFEST = KeyKind("manifest", MAX_RECORD_BYTES, owner_only=True)
# A lineage record keeps the hashes of the newest 2 * keyframe_every + 8 versions (~70 bytes
# each): a record's cap leaves room for hundreds.
LINEAGE = KeyKind("lineage", MAX_RECORD_BYTES, owner_only=True)
RUN_END = KeyKind("run end", RUN_END_BYTES, owner_only=True)
ROUTES = KeyKind("routes", ROUTE_RECORD_BYTES)
OFFER = KeyKind("offer", OFFER_BYTES)
# An Ed25519 peer id, as a subkey names its writer.
PEER_ID_CHARS = 52


def entry_bytes(kind: KeyKind) -> int:
    """The most one record of `kind` takes here (as `BoundedDHTStorage` counts it)."""
    return stored_value_bytes(kind.max_body_bytes) + PEER_ID_CHARS + ENTRY_OVERHEAD_BYTES


# What a peer other than the owner keeps in a run: its announcement in its stage (and in the
# stage it just left, until that one expires), its route record and its offer. The owner may
# keep one record under each key of its run (`RunNamespace.owner_bytes`).
MAX_WRITER_BYTES = 2 * entry_bytes(STAGE) + entry_bytes(ROUTES) + entry_bytes(OFFER)


def key_id(key: str) -> DHTID:
    """The DHT id of `key` as hivemind stores it (`DHTNode.store` hashes the key the same way)."""
    return DHTID.generate(source=key)


@dataclass(frozen=True)
class RunNamespace:
    """The keys of run `run` owned by the peer id `owner`, with `num_stages` stages, whose peers
    announce themselves every `announce_every_s`."""

    run: str
    owner: str
    num_stages: int
    announce_every_s: float

    @classmethod
    def of(cls, config: RunConfig, owner: str) -> RunNamespace:
        """The namespace of the run `config` describes, owned by `owner`."""
        return cls(config.name, owner, config.num_stages, config.swarm.announce_every_s)

    @property
    def owner_bytes(self) -> int:
        """The most the owner keeps here: a record under each key of its run, and its routes."""
        return sum(map(entry_bytes, self.kinds().values())) + entry_bytes(ROUTES)

    @property
    def max_ttl_s(self) -> float:
        """The longest a record of this run (or a route record) may be kept."""
        return max(MAX_RECORD_TTL_S, RECORD_LIFE_PERIODS * self.announce_every_s)

    def kinds(self) -> dict[DHTID, KeyKind]:
        """The kind of each key of the run, by its DHT id."""
        found = {key_id(coordinator_key(self.run)): MANIFEST,
                 key_id(ended_key(self.run)): RUN_END}
        for stage in range(self.num_stages):
            found[key_id(stage_key(self.run, stage))] = STAGE
            found[key_id(lineage_key(self.run, stage))] = LINEAGE
        return found


class StorageRefused(DecentrlError, ValueError):
    """A record this node would not keep: the reason is one of `StorageRefusal`."""

    def __init__(self, reason: StorageRefusal, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: StorageRefusal = reason


@dataclass
class _Entry:
    writer: str
    size: int
    expiration_time: DHTExpiration


class BoundedDHTStorage(DHTLocalStorage):
    """The records this node keeps for the DHT, within the bounds above (module docstring). Used
    on the node's loop; `refused` and `join` may be called from any thread."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._kinds: dict[DHTID, KeyKind] = {}
        self._owner: str | None = None
        self._owner_bytes = 0
        self.max_ttl_s = MAX_RECORD_TTL_S
        self._entries: dict[tuple[DHTID, str], _Entry] = {}
        self._expiring: list[tuple[DHTExpiration, DHTID, str]] = []  # a heap
        self._writer_bytes: Counter[str] = Counter()
        self._key_bytes: Counter[DHTID] = Counter()
        self._key_writers: Counter[DHTID] = Counter()
        self.stored_bytes = 0
        self._refused: Counter[str] = Counter()

    def join(self, namespace: RunNamespace) -> None:
        """Keep `namespace`'s keys from now on (instead of any run's this node joined before;
        what it kept of that run expires by itself)."""
        with self._lock:
            self._kinds, self._owner = namespace.kinds(), namespace.owner
            self._owner_bytes = namespace.owner_bytes
            self.max_ttl_s = namespace.max_ttl_s

    def check_ttl(self, key: str, ttl_s: float) -> None:
        """Raise ValueError if this node would refuse its own record under `key` for living
        `ttl_s` (so would its run's other nodes)."""
        if not 0 < ttl_s <= self.max_ttl_s:
            raise ValueError(f"a record under {key!r} announced for {ttl_s:g}s: the DHT keeps "
                             f"records for up to {self.max_ttl_s:.0f}s, renew it instead")

    @property
    def refused(self) -> dict[str, int]:
        """Records refused so far, by reason."""
        with self._lock:
            return dict(self._refused)

    def key_bytes(self, key: DHTID) -> int:
        """What the records kept under `key` take (in memory, and in a reply that carries them)."""
        self._expire(get_dht_time())
        return self._key_bytes.get(key, 0)

    def store(self, key: DHTID, value: BinaryDHTValue, expiration_time: DHTExpiration,
              subkey: Subkey | None = None) -> bool:
        if subkey is None:  # every record of ours is under its writer's peer id
            self._count("no subkey")
            return False
        return self.store_subkey(key, subkey, value, expiration_time)

    def store_subkey(self, key: DHTID, subkey: Subkey, value: BinaryDHTValue,
                     expiration_time: DHTExpiration) -> bool:
        now = get_dht_time()
        self._expire(now)
        try:
            entry = self._admit(key, subkey, value, expiration_time, now)
        except StorageRefused as refused:
            self._count(refused.reason)
            log.debug("DHT record not kept: %s", refused)
            return False
        if not super().store_subkey(key, subkey, value, expiration_time):
            return False  # hivemind keeps a newer record of this writer
        old = self._entries.get((key, entry.writer))
        if old is None:  # a renewal keeps its place in the heap (see _expire)
            self._key_writers[key] += 1
            heapq.heappush(self._expiring, (expiration_time, key, entry.writer))
        self._change(key, entry.writer, entry.size - (old.size if old else 0))
        self._entries[key, entry.writer] = entry
        return True

    def _admit(self, key: DHTID, subkey: Subkey, value: BinaryDHTValue,
               expiration_time: DHTExpiration, now: float) -> _Entry:
        """The entry a record would take; StorageRefused naming the first bound it breaks."""
        if not isinstance(subkey, str):
            raise StorageRefused("no subkey", f"a subkey of type {type(subkey).__name__}")
        writer = subkey
        with self._lock:
            kind, owner, owner_bytes = self._kinds.get(key), self._owner, self._owner_bytes
        if kind is None and key == key_id(route_key(writer)):
            kind = ROUTES
        if kind is None and key == key_id(offer_key(writer)):
            kind = OFFER
        if kind is None:
            raise StorageRefused("outside this node's run", f"a record of {writer[-8:]} under a "
                                 "key that is no route or offer of its writer's nor a key of "
                                 "this run")
        if kind.owner_only and writer != owner:
            raise StorageRefused("not its writer's key", f"the run's {kind.name} is its owner's "
                                 f"record, not {writer[-8:]}'s")
        if expiration_time > now + self.max_ttl_s + MAX_DHT_TIME_DISCREPANCY_SECONDS:
            raise StorageRefused("expiry too far", f"{writer[-8:]}'s {kind.name} record would "
                                 f"live {expiration_time - now:.0f}s, over {self.max_ttl_s:.0f}s")
        if len(value) > stored_value_bytes(kind.max_body_bytes):
            raise StorageRefused("over its kind's size", f"{writer[-8:]}'s {kind.name} record "
                                 f"of {len(value)} bytes, over {kind.max_body_bytes} of body")
        entry = _Entry(writer, len(value) + len(writer) + ENTRY_OVERHEAD_BYTES, expiration_time)
        old = self._entries.get((key, writer))
        grows = entry.size - (old.size if old else 0)
        if old is None and self._key_writers[key] >= kind.max_writers:
            raise StorageRefused("key full", f"a {kind.name} key holds {kind.max_writers} "
                                 f"writers' records already; {writer[-8:]} is refused")
        budget = owner_bytes if writer == owner else MAX_WRITER_BYTES
        if self._writer_bytes[writer] + grows > budget:
            raise StorageRefused("writer over its budget", f"{writer[-8:]} keeps "
                                 f"{self._writer_bytes[writer]} bytes here, {budget} at most")
        if self._key_bytes[key] + grows > MAX_KEY_BYTES:
            raise StorageRefused("key full", f"a {kind.name} key holds {self._key_bytes[key]} "
                                 f"bytes, {MAX_KEY_BYTES} at most")
        if self.stored_bytes + grows > MAX_STORED_BYTES:
            raise StorageRefused("storage full", f"this node keeps {self.stored_bytes} bytes for "
                                 f"the DHT, {MAX_STORED_BYTES} at most")
        return entry

    def _change(self, key: DHTID, writer: str, grows: int) -> None:
        self._writer_bytes[writer] += grows
        self._key_bytes[key] += grows
        self.stored_bytes += grows
        for table, name in ((self._writer_bytes, writer), (self._key_bytes, key)):
            if table[name] <= 0:
                del table[name]

    def _expire(self, now: float) -> None:
        """Forget the records whose time ran out, in hivemind's storage too (it drops them only
        when their key is next touched)."""
        while self._expiring and self._expiring[0][0] < now:
            expiration_time, key, writer = heapq.heappop(self._expiring)
            entry = self._entries[key, writer]
            if entry.expiration_time > expiration_time:
                # Renewed since: back in the heap at its new time (one item per record, however
                # often its writer renews it).
                heapq.heappush(self._expiring, (entry.expiration_time, key, writer))
                continue
            del self._entries[key, writer]
            self._change(key, writer, -entry.size)
            self._key_writers[key] -= 1
            if self._key_writers[key] <= 0:
                del self._key_writers[key]
            kept = self.data.get(key)
            if kept is not None and isinstance(kept.value, DictionaryDHTValue):
                del kept.value[writer]

    def _count(self, reason: StorageRefusal) -> None:
        with self._lock:
            self._refused[reason] += 1


class NoCache(DHTLocalStorage):
    """The DHT's cache, holding nothing: every record pushed into it is refused and counted."""

    def __init__(self, storage: BoundedDHTStorage) -> None:
        super().__init__()
        self.storage = storage

    def store(self, key: DHTID, value: BinaryDHTValue, expiration_time: DHTExpiration,
              subkey: Subkey | None = None) -> bool:
        self.storage._count("cache")
        return False

    def store_subkey(self, key: DHTID, subkey: Subkey, value: BinaryDHTValue,
                     expiration_time: DHTExpiration) -> bool:
        return self.store(key, value, expiration_time, subkey)


class FindReplyTooLarge(DecentrlError, ValueError):
    """A DHT find request whose reply would not fit in one message."""


class FindReplyBound(AuthorizerBase):
    """Refuses a DHT find request before it is answered when the records it asks for would not
    fit in one reply (MAX_FIND_REPLY_BYTES, under the p2p daemon's 4 MiB message cap).

    Hivemind's own error path for an oversized reply is broken: `ControlClient.
    _handle_persistent_request` (hivemind/p2p/p2p_daemon_bindings/control.py) builds its "response
    size exceeds message size limit" answer with a field that `PersistentConnectionRequest` does
    not have (`callUnaryResponse`, not `unaryResponse`), so it raises instead, the asker gets no
    answer until its timeout and drops this node from its routing table, and the reply was built
    in full first. The bounds of BoundedDHTStorage keep any one key under MAX_KEY_BYTES; this
    check keeps a request for several keys (or one key many times) from adding up past the cap:
    its refusal is a short error that the working path carries.

    It is hivemind's authorizer hook (`DHTNode.create(authorizer=...)`), the one place that sees a
    request before its handler runs; it signs and checks nothing else."""

    def __init__(self, storage: BoundedDHTStorage) -> None:
        self.storage = storage

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        if isinstance(request, dht_pb2.FindRequest):
            reply = sum(self.storage.key_bytes(DHTID.from_bytes(key)) for key in request.keys)
            if reply > MAX_FIND_REPLY_BYTES:
                raise FindReplyTooLarge(f"a DHT reply for {len(request.keys)} keys would carry "
                                        f"{reply} bytes, over {MAX_FIND_REPLY_BYTES}: ask for "
                                        "fewer keys at once")
        return True

    async def sign_request(self, request: AuthorizedRequestBase,
                           service_public_key: RSAPublicKey | None) -> None:
        return None

    async def sign_response(self, response: AuthorizedResponseBase,
                            request: AuthorizedRequestBase) -> None:
        return None

    async def validate_response(self, response: AuthorizedResponseBase,
                                request: AuthorizedRequestBase) -> bool:
        return True
