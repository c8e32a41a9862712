"""Getting a stage's new weights to every inference replica of that stage, over consumer uplinks.

The stage's training peer runs a `WeightPublisher`: after every optimizer step it encodes an
update against the state it has published (sync/delta.py), cuts the payload into chunks and
hashes each. Every `keyframe_every` versions, and after a rollback, it also keeps a keyframe (the
dense published state). The run's coordinator asks it for the hash of each new published state
and signs it into the stage's lineage (protocol.py `LineageRecord`, in the DHT): the lineage
names the stage's admitted publisher and the state hash of each recent version.

Each replica runs a `WeightFollower`. It follows the publisher the coordinator's lineage names,
and only to states the lineage vouches for. It asks the publisher for a plan from the state it
holds:
the chain of deltas after its (version, hash), or, when it is not on that chain (a late joiner,
a rollback, a corrupt state), the latest keyframe and the deltas after it. Chunks spread like a
swarm: the replicas of the stage, sorted by peer id, each own every n-th chunk, which they take
from the publisher; every other chunk they take from its owner, which holds the request open
while it is still fetching that chunk itself. So the publisher's uplink carries each update about
once, each replica's about once, and the time to reach every replica stays nearly flat as
replicas are added. An owner is waited on only once it has served this replica good chunks (a
few probes after each update find out, off its path); a chunk whose owner is passed over, fails or
serves bad bytes comes from the publisher instead, and the source is avoided a while
(sync/sources.py).

A replica applies an update only if the state hash its manifest promises is the one the
coordinator signed for that version (an update the coordinator has not signed yet waits for the
next round), applies it to its own float32 copy of the published state, checks the hash, and only
then writes the changed entries into the model it serves, on its
compute thread between two inference requests: generations in flight go on, and every reply says
which version produced it. A hash mismatch puts the old values back and asks for a keyframe.

Bytes sent and received are counted per update and per peer (`traffic`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from decentrl.config import SyncConfig
from decentrl.errors import DecentrlError
from decentrl.net.compute import Priority
from decentrl.net.link import MessageLost
from decentrl.net.node import PeerRefused, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    SYNC_CHUNK,
    SYNC_PLAN,
    ChunkRequest,
    LineageRecord,
    PeerRecord,
    ServedFidelity,
    SyncPlan,
    SyncPlanRequest,
    UpdateManifest,
    lineage_key,
    stage_key,
)
from decentrl.net.records import decode_records
from decentrl.net.session import owner_session, session_mismatch
from decentrl.net.wire import WireError
from decentrl.sync.chunks import StoredUpdate, UpdateServer, count_bytes
from decentrl.sync.delta import (
    PublishedState,
    TensorChange,
    UpdateKind,
    apply_payload,
    cpu_float32_copy,
    decode_payload,
    encode_delta,
    encode_keyframe,
    payload_bytes,
    served_fidelity,
    state_hash,
    undo_changes,
)
from decentrl.sync.sources import ChunkSources, Source

log = logging.getLogger(__name__)

MIN_CHUNK_BYTES = 2**10
MAX_CHUNK_BYTES = 2 * 2**20
# Updates a replica keeps to serve others besides its newest keyframe.
KEPT_UPDATES = 4


class SyncError(DecentrlError, RuntimeError):
    """An update could not be fetched or did not check out; the follower tries again later."""


def chunk_size_for(size: int, chunks: int) -> int:
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, math.ceil(size / chunks)))


def make_update(stage: int, version: int, kind: UpdateKind, base: tuple[int, str],
                state_hash_after: str, payload: bytes, chunks: int) -> StoredUpdate:
    size = chunk_size_for(len(payload), chunks)
    view = memoryview(payload)  # chunks hashed in place, not copied
    hashes = [hashlib.sha256(view[i:i + size]).digest() for i in range(0, len(payload), size)]
    manifest = UpdateManifest(stage=stage, version=version, kind=kind, base_version=base[0],
                              base_hash=base[1], state_hash=state_hash_after, size=len(payload),
                              chunk_size=size, chunk_hashes=hashes)
    return StoredUpdate.whole(manifest, payload)


class WeightPublisher(UpdateServer):
    """A training peer's side: one stage's published state, its deltas and latest keyframe."""

    def __init__(self, node: SwarmNode, run: str, stage: int, sync: SyncConfig, version: int,
                 tensors: Mapping[str, torch.Tensor], timeout_s: float = 60.0,
                 exact_versions: Collection[int] = ()) -> None:
        """`exact_versions` are published whole (a keyframe of the learner's weights, as in
        dense mode) even in sparse mode: the end of a supervised warm-up, after which the
        replicas generate and the learner has moved far more than sparse updates carried."""
        super().__init__(node, run, stage, sync)
        self.timeout_s = timeout_s
        self.exact_versions = frozenset(exact_versions)
        self.state = PublishedState.of(version, tensors)
        # What the learner's movement is measured from (its first state, or the one it rolled
        # back to), and the fidelity of each recent version (`served_fidelity`).
        self.start = cpu_float32_copy(self.state.tensors)
        self.fidelity: OrderedDict[int, ServedFidelity] = OrderedDict()
        self.keyframe: StoredUpdate | None = None
        # Encoding runs on its own thread, one update after another (each builds on the last),
        # so the compute thread goes back to training at once.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"publish-{stage}")
        self._lock = threading.Lock()
        # Called on the encoding thread with each new published state and what the update changed
        # (None: the state was replaced whole, a rollback or a dense update): a training peer
        # keeps its copy of what the replicas serve by it (stage/replica.py `ServedWeights`).
        self.on_published: Callable[[PublishedState, Mapping[str, TensorChange] | None],
                                    None] = lambda state, changes: None
        node.serve(SYNC_PLAN, self._serve_plan)
        self._store_keyframe()

    # ---- publishing (from the compute thread) ---------------------------------------------

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        """Publish `version` of the weights (a private copy is taken before this returns)."""
        return self._encoder.submit(self._encode, version, cpu_float32_copy(tensors))

    def served(self) -> Future[PublishedState]:
        """A copy of what replicas are brought to, once every update submitted before this call
        is encoded (so at the newest published version). With sparse updates this is not the
        learner's weights: the entries not yet sent still wait in the error feedback."""
        return self._encoder.submit(lambda: PublishedState(
            self.state.version, {k: v.clone() for k, v in self.state.tensors.items()},
            self.state.hash))

    def published(self, version: int) -> Future[tuple[str, ServedFidelity | None] | None]:
        """The hash of the published state at `version` once every update submitted before this
        call is encoded: the current state's, or that of an update still kept (a signing that
        failed is retried after later versions are out); None if neither is at `version`. With
        it, the fidelity measured when that version was published (None if not kept)."""
        def hash_at() -> tuple[str, ServedFidelity | None] | None:
            fidelity = self.fidelity.get(version)
            with self._lock:
                if self.state.version == version:
                    return self.state.hash, fidelity
            kept = [u.manifest for u in list(self.updates.values())
                    if u.manifest.version == version]
            return (kept[0].state_hash, fidelity) if kept else None
        return self._encoder.submit(hash_at)

    def reset(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Future[None]:
        """Start over from these weights (a rollback to a checkpoint): a new keyframe, no deltas."""
        return self._encoder.submit(self._rollback, version, cpu_float32_copy(tensors))

    def _rollback(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        self.start = cpu_float32_copy(snapshot)
        self.fidelity.clear()
        self._restart(version, snapshot)

    def _restart(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.state = PublishedState.owning(version, snapshot)
        self.on_published(self.state, None)
        self.node.run(self._drop_all(), timeout=self.timeout_s)
        self._store_keyframe()

    async def _drop_all(self) -> None:
        self.updates.clear()

    def _encode(self, version: int, snapshot: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        if self.sync.mode == "dense" or version in self.exact_versions:
            self._restart(version, snapshot)
            self._measure(version, snapshot)
            return
        base = (self.state.version, self.state.hash)
        payload = encode_delta(self.state, snapshot, self.sync.density, self.sync.selection,
                               self.sync.values)
        with self._lock:
            # The same code a replica runs on the same payload: both sides stay bit-identical.
            changes = apply_payload(self.state, payload, version)
            self.state.hash = state_hash(self.state.tensors)
        self.on_published(self.state, changes)
        self._measure(version, snapshot)
        update = make_update(self.stage, version, "delta", base, self.state.hash,
                             payload_bytes(payload), self.sync.chunks_per_update)
        self.node.run(self._add_delta(update), timeout=self.timeout_s)
        if version % self.sync.keyframe_every == 0:
            self._store_keyframe()
        log.info("stage %d v%d: delta of %d bytes in %.2fs", self.stage, version,
                 update.manifest.size, time.perf_counter() - started)

    def _measure(self, version: int, learner: dict[str, torch.Tensor]) -> None:
        """Keep the fidelity of the state just published, for the coordinator (encoding thread,
        which alone writes the published state)."""
        self.fidelity[version] = served_fidelity(learner, self.state, self.start)
        while len(self.fidelity) > self.sync.keyframe_every:
            self.fidelity.popitem(last=False)

    async def _add_delta(self, update: StoredUpdate) -> None:
        await self.add(update)
        deltas = [key for key in self.updates if key[0] == "delta"]
        for key in deltas[:-self.sync.keyframe_every]:
            del self.updates[key]

    def _store_keyframe(self) -> None:
        with self._lock:
            payload = payload_bytes(encode_keyframe(self.state))
            version, hash_ = self.state.version, self.state.hash
        update = make_update(self.stage, version, "keyframe", (-1, ""), hash_, payload,
                             self.sync.chunks_per_update)
        old = self.keyframe
        self.keyframe = update

        async def swap() -> None:
            if old is not None:
                self.updates.pop(old.key, None)
            await self.add(update)
        self.node.run(swap(), timeout=self.timeout_s)

    def wait(self, timeout: float) -> None:
        """Until every update submitted so far is published."""
        self._encoder.submit(lambda: None).result(timeout)

    # ---- planning ------------------------------------------------------------------------

    async def _serve_plan(self, request: Request[SyncPlanRequest]) -> Reply:
        body = request.body
        if body.stage != self.stage:
            raise WireError(f"this peer publishes stage {self.stage}, not {body.stage}")
        return Reply(self.plan(body.version, body.state_hash))

    def plan(self, version: int, hash_: str) -> SyncPlan:
        """The updates that take a replica at (version, hash) to the newest published state."""
        deltas = {v: u.manifest for (kind, v), u in self.updates.items() if kind == "delta"}
        newest = max((u.manifest for u in self.updates.values()), key=lambda m: m.version)
        if (version, hash_) == (newest.version, newest.state_hash):
            return SyncPlan(version=newest.version, manifests=[])
        chain, at, current = [], version, hash_
        while at + 1 in deltas and deltas[at + 1].base_hash == current:
            chain.append(deltas[at + 1])
            at, current = at + 1, deltas[at + 1].state_hash
        if at == newest.version:
            return SyncPlan(version=newest.version, manifests=chain)
        assert self.keyframe is not None
        start = self.keyframe.manifest
        after = [deltas[v] for v in sorted(deltas) if v > start.version]
        return SyncPlan(version=newest.version, manifests=[start, *after])

    def close(self) -> None:
        self._encoder.shutdown(wait=True, cancel_futures=True)
        self.node.unserve(SYNC_PLAN)
        super().close()


Commit = Callable[[int, dict[str, TensorChange]], None]


class WeightFollower(UpdateServer):
    """An inference replica's side: it holds the stage's published state (float32, CPU) and
    follows the publisher that the run owner's lineage names, committing each checked update into
    the served model via `commit` (run on the compute thread)."""

    def __init__(self, node: SwarmNode, run: str, stage: int, sync: SyncConfig,
                 state: PublishedState, commit: Commit, timeout_s: float, ban_s: float,
                 owner: str) -> None:
        """`owner`: the peer id of the run's owner, whose signed lineage says which updates to
        take."""
        super().__init__(node, run, stage, sync)
        self.state, self.commit, self.owner = state, commit, owner
        self.timeout_s = timeout_s
        self.sources = ChunkSources(timeout_s + sync.chunk_wait_s, sync.chunk_wait_s, ban_s)
        self.probing: asyncio.Future[None] | None = None
        self.hash_mismatches = 0
        self.skipped_records = 0  # malformed records met so far, once per lookup that met each
        self.stale_records = 0  # lineages of another session than the manifest's, per lookup
        self.session: str | None = None  # of the owner's newest manifest seen (net/session.py)
        self._want_keyframe = False
        self._sync_lock: asyncio.Lock | None = None
        self.wake = asyncio.Event()

    def expects(self, kind: UpdateKind, version: int) -> bool:
        if version > self.state.version:
            self.wake.set()  # someone already fetches a newer update: look for it now
            return True
        return False

    async def sync_once(self) -> bool:
        """Catch up with the stage's publisher; True if the served weights changed. One sync at a
        time: two would apply the same update twice."""
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        async with self._sync_lock:
            return await self._sync()

    async def _sync(self) -> bool:
        lineage = await self.lineage()
        if lineage is None:
            return False
        newest = max(lineage.hashes)
        if (self.state.version, self.state.hash) == (newest, lineage.hashes[newest]):
            return False
        publisher = lineage.publisher
        try:
            plan, _ = await self.node.call(
                publisher, SYNC_PLAN, SyncPlanRequest(
                    stage=self.stage, version=self.state.version,
                    state_hash="" if self._want_keyframe else self.state.hash),
                timeout=self.timeout_s)
        except (RemoteError, MessageLost, WireError) as error:
            raise SyncError(f"the publisher of stage {self.stage} ({publisher[-8:]}) did not "
                            f"answer: {error}") from error
        applied = False
        for manifest in plan.manifests:
            signed = lineage.hashes.get(manifest.version)
            if signed is None and manifest.version > newest:
                break  # published, not yet signed by the owner: the next round takes it
            if signed != manifest.state_hash:
                raise SyncError(
                    f"stage {self.stage} v{manifest.version}: the publisher {publisher[-8:]} "
                    f"offers state {manifest.state_hash[:12]}, the run owner signed "
                    f"{signed[:12] if signed else 'no state'} for that version; not applied")
            await self._fetch_and_apply(manifest, publisher)
            applied = True
        return applied

    async def lineage(self) -> LineageRecord | None:
        """The run owner's signed lineage of this stage, or None while there is none (or it is
        malformed, which is counted: a reader never fails on a record)."""
        entries, session = await asyncio.gather(
            self.node.lookup(lineage_key(self.run, self.stage)),
            owner_session(self.node, self.run, self.owner))
        owned = {self.owner: entries[self.owner]} if self.owner in entries else {}
        found, skipped = decode_records(owned, LineageRecord, self.stage)
        self.skipped_records += skipped
        lineage = found.get(self.owner)
        # Signed at an earlier start of the run (net/session.py): its publisher and versions are
        # void. The session is the newest manifest's, kept while none is live (before the
        # first, there is none to hold a lineage to).
        self.session = session or self.session
        stale = lineage is not None and self.session is not None \
            and session_mismatch("LineageRecord", lineage.session, self.session)
        if stale:
            self.stale_records += 1
            log.info("stage %d: %s", self.stage, stale)
            return None
        return lineage if lineage is not None and lineage.hashes else None

    async def _replicas(self) -> list[str]:
        """The inference replicas of this stage (this one included), sorted by peer id. Malformed
        announcements are skipped and counted: anyone can write there."""
        found, skipped = decode_records(await self.node.lookup(stage_key(self.run, self.stage)),
                                        PeerRecord, self.stage)
        self.skipped_records += skipped
        return sorted({self.node.peer_id} | {peer for peer, record in found.items()
                                             if record.role == "inference"})

    async def _fetch_and_apply(self, manifest: UpdateManifest, publisher: str) -> None:
        if manifest.stage != self.stage:
            raise SyncError(f"plan for stage {self.stage} holds an update of stage "
                            f"{manifest.stage}")
        key = (manifest.kind, manifest.version)
        update = self.updates.get(key)
        if update is None or update.manifest != manifest:
            update = StoredUpdate.empty(manifest)
            await self.add(update)
        if not update.complete:
            await self._fetch(update, publisher)
        loop = asyncio.get_running_loop()
        changes = await loop.run_in_executor(None, self._apply, manifest, update.data)
        await self.node.compute(self.commit, manifest.version, changes, priority=Priority.WEIGHTS)
        from_publisher = update.received[publisher]
        log.info("stage %d %s v%d applied: %d bytes, %d from the publisher, %d from %d replicas",
                 self.stage, manifest.kind, manifest.version, manifest.size, from_publisher,
                 sum(update.received.values()) - from_publisher,
                 len([p for p in update.received if p != publisher]))
        self._forget_old()

    async def _fetch(self, update: StoredUpdate, publisher: str) -> None:
        me = self.node.peer_id
        owners = self.sources.owners(await self._replicas(), me) \
            if self.sync.peer_exchange else [me]
        count = len(update.have)
        rank = owners.index(me)
        # Own chunks first (they come from the publisher and others wait for them).
        order = sorted(range(count), key=lambda j: (j - rank) % len(owners))
        slots = asyncio.Semaphore(self.sync.parallel_fetches)

        async def get(index: int) -> None:
            owner = owners[index % len(owners)]
            # Another replica reached only through a relay is skipped: relayed connections
            # carry 128 KiB each (net/circuits.py), and two replicas fetching from each other
            # over one keep replacing it under each other's calls (measured: 6.6 s for what
            # the publisher alone delivers in 2.0 s; bench update-spread --netns).
            relayed = owner != me and self.node.circuits.get(owner) is not None
            sources = self.sources.for_chunk(owner, me, publisher, relayed)
            async with slots:
                for number, source in enumerate(sources):
                    if update.have[index] or \
                            (source.peer != publisher and self.sources.avoids(source.peer)):
                        continue
                    if number:
                        self.sources.fell_back()
                    if await self._fetch_chunk(update, index, source, publisher):
                        return
            if not update.have[index]:
                raise SyncError(f"chunk {index} of {update.manifest.kind} "
                                f"v{update.manifest.version} came from none of "
                                f"{[s.peer[-8:] for s in sources]}")
        await asyncio.gather(*(get(index) for index in order))
        if self.probing is None or self.probing.done():
            self.probing = asyncio.ensure_future(self._probe(update, owners, publisher))

    async def _probe(self, update: StoredUpdate, owners: list[str], publisher: str) -> None:
        """Ask a few owners no record vouches for yet for one chunk each of `update`, which
        this replica holds: whoever serves it well is waited on from the next update on, whoever
        stays silent is avoided a while (sync/sources.py). Off the update's path: a fake owner
        delays no update."""
        async def probe(source: Source) -> None:
            await self._fetch_chunk(update, owners.index(source.peer) % len(update.have),
                                    source, publisher)
        # An owner reached only through a relay is never asked for chunks (see `_fetch`).
        direct = [peer for peer in owners if self.node.circuits.get(peer) is None]
        await asyncio.gather(*(probe(source)
                               for source in self.sources.probes(direct, self.node.peer_id)))

    async def probed(self) -> None:
        """Once the probes after the last update are answered or timed out."""
        if self.probing is not None:
            await asyncio.shield(self.probing)

    async def _fetch_chunk(self, update: StoredUpdate, index: int, source: Source,
                           publisher: str) -> bool:
        manifest = update.manifest
        span = update.span(index)
        peer = source.peer
        for attempt in range(2):
            piece = self.node.circuits.piece_bytes(peer)
            try:
                raw = await self._chunk_from(source, manifest, index, span.stop - span.start,
                                             piece)
                break
            except (RemoteError, MessageLost, WireError) as error:
                log.debug("chunk %d of v%d from %s: %s", index, manifest.version, peer[-8:],
                          error)
                # Asked whole, then found to be reachable only through a relay: once more, in
                # pieces.
                if attempt or piece is not None or self.node.circuits.piece_bytes(peer) is None:
                    # A peer that answered (a refusal, a malformed reply) is alive: only one
                    # that was silent or could not be dialed is backed off.
                    if isinstance(error, RemoteError) and not isinstance(error, PeerRefused):
                        self.sources.no_answer(peer, publisher)
                    return False
        count_bytes(update.received, peer, len(raw))
        count_bytes(self.received_total, peer, len(raw))
        if hashlib.sha256(raw).digest() != manifest.chunk_hashes[index]:
            self.sources.bad_chunk(peer)
            log.warning("stage %d: %s served a bad chunk %d of %s v%d; banned for %.0fs",
                        self.stage, peer[-8:], index, manifest.kind, manifest.version,
                        self.sources.ban_s)
            return False
        self.sources.good_chunk(peer)
        if not update.have[index]:  # a probe's chunk is in hand already
            update.put(index, raw)
            await self._notify()
        return True

    async def _chunk_from(self, source: Source, manifest: UpdateManifest, index: int,
                          length: int, piece: int | None) -> bytes:
        """Chunk `index` as `source` sends it: in one reply, or in pieces of `piece` bytes."""
        pieces = [(0, 0)] if piece is None or length <= piece else \
            [(offset, min(piece, length - offset)) for offset in range(0, length, piece)]
        # A source reached through a relay is not asked to hold the request for a chunk it is
        # still fetching: the wait would hold room on the relayed connection.
        wait_s = self.sync.chunk_wait_s if piece is None else 0.0
        raw = bytearray()
        for offset, count in pieces:
            request = ChunkRequest(stage=self.stage, kind=manifest.kind, version=manifest.version,
                                   index=index, wait_s=wait_s, offset=offset, count=count)
            _, tensors = await self.node.call(source.peer, SYNC_CHUNK, request,
                                              timeout=source.timeout_s)
            data = tensors.get("data")
            if data is not None and data.dtype == torch.uint8:
                raw += data.numpy().tobytes()
        return bytes(raw)

    def _apply(self, manifest: UpdateManifest, data: bytes | bytearray
               ) -> dict[str, TensorChange]:
        """Apply a fetched update to the published state and check its hash (a worker thread;
        the served model is not touched here)."""
        # One intra-op thread (a per-thread setting): the apply is light, and more threads spin
        # against the inference that keeps this peer's cores busy (1.3 s instead of 0.1 s).
        torch.set_num_threads(1)
        if manifest.kind == "delta" and (manifest.base_version, manifest.base_hash) != \
                (self.state.version, self.state.hash):
            raise SyncError(f"delta v{manifest.version} applies to v{manifest.base_version}, this "
                            f"replica holds v{self.state.version}")
        payload = decode_payload(data, {n: t.shape for n, t in self.state.tensors.items()})
        before = (self.state.version, self.state.hash)
        changes = apply_payload(self.state, payload, manifest.version)
        after = state_hash(self.state.tensors)
        if after != manifest.state_hash:
            undo_changes(self.state, changes, *before)
            self.hash_mismatches += 1
            self._want_keyframe = True
            raise SyncError(f"stage {self.stage} v{manifest.version}: state hash {after[:12]} "
                            f"after applying, the publisher promised {manifest.state_hash[:12]}; "
                            "undone, resynchronizing from a keyframe")
        self.state.hash = after
        self._want_keyframe = False
        return changes

    def _forget_old(self) -> None:
        deltas = [key for key in self.updates if key[0] == "delta"]
        keyframes = [key for key in self.updates if key[0] == "keyframe"]
        for key in deltas[:-KEPT_UPDATES] + keyframes[:-1]:
            del self.updates[key]
