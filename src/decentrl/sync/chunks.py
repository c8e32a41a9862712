"""What publishers and followers of a stage's weights share (sync/distribute.py): the updates a
peer holds, whole or in part, served chunk by chunk (`sync_chunk`) to the stage's replicas, and
the bytes each peer sent and received for them."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from decentrl.config import SyncConfig
from decentrl.errors import DecentrlError
from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import SYNC_CHUNK, ChunkRequest, Empty, UpdateManifest
from decentrl.net.wire import WireError
from decentrl.sync.delta import UpdateKind

# Peers counted by name in a traffic counter. Anyone may ask for chunks, and sources come from
# announcements anyone can write, so past this the bytes of further peers are counted together
# under OTHER_PEERS: totals stay exact, the table stays small. A stage has tens of replicas.
PEERS_COUNTED = 256
OTHER_PEERS = "others"


def count_bytes(counter: Counter[str], peer: str, count: int) -> None:
    """Add `count` bytes to `peer`'s entry, or to OTHER_PEERS once PEERS_COUNTED peers have
    one."""
    counter[peer if peer in counter or len(counter) < PEERS_COUNTED else OTHER_PEERS] += count


@dataclass
class StoredUpdate:
    """An update's manifest and as much of its payload as this peer holds, with its traffic."""

    manifest: UpdateManifest
    data: bytearray
    have: list[bool]
    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)

    @classmethod
    def empty(cls, manifest: UpdateManifest) -> StoredUpdate:
        return cls(manifest, bytearray(manifest.size), [False] * len(manifest.chunk_hashes))

    @classmethod
    def whole(cls, manifest: UpdateManifest, payload: bytes) -> StoredUpdate:
        return cls(manifest, bytearray(payload), [True] * len(manifest.chunk_hashes))

    @property
    def key(self) -> tuple[UpdateKind, int]:
        return self.manifest.kind, self.manifest.version

    def span(self, index: int) -> slice:
        start = index * self.manifest.chunk_size
        return slice(start, min(start + self.manifest.chunk_size, self.manifest.size))

    def put(self, index: int, data: bytes) -> None:
        self.data[self.span(index)] = data
        self.have[index] = True

    @property
    def complete(self) -> bool:
        return all(self.have)



@dataclass
class TrafficRow:
    kind: UpdateKind
    version: int
    peer: str
    sent: int
    received: int


class UpdateServer:
    """What publishers and followers share: the updates this peer holds, served chunk by chunk
    (sync_chunk), and the traffic they caused. Its state lives on the node's loop."""

    def __init__(self, node: SwarmNode, run: str, stage: int, sync: SyncConfig) -> None:
        self.node, self.run, self.stage, self.sync = node, run, stage, sync
        self.updates: OrderedDict[tuple[UpdateKind, int], StoredUpdate] = OrderedDict()
        # Over every update, also those no longer held: bytes by peer.
        self.sent_total: Counter[str] = Counter()
        self.received_total: Counter[str] = Counter()
        self._arrived: asyncio.Condition | None = None
        node.serve(SYNC_CHUNK, self._serve_chunk)

    def _condition(self) -> asyncio.Condition:
        if self._arrived is None:
            self._arrived = asyncio.Condition()
        return self._arrived

    def expects(self, kind: UpdateKind, version: int) -> bool:
        """Whether a chunk of this update, missing now, may still arrive here (followers say yes
        for updates newer than their state)."""
        return False

    async def _serve_chunk(self, request: Request[ChunkRequest]) -> Reply:
        body = request.body
        if body.stage != self.stage:
            raise WireError(f"this peer serves stage {self.stage}, not {body.stage}")
        key = (body.kind, body.version)

        def ready() -> bool:
            update = self.updates.get(key)
            return update is not None and 0 <= body.index < len(update.have) \
                and update.have[body.index]
        if not ready() and body.wait_s > 0 and self.expects(body.kind, body.version):
            condition = self._condition()
            async with condition:
                try:
                    await asyncio.wait_for(condition.wait_for(ready),
                                           min(body.wait_s, self.sync.chunk_wait_s))
                except TimeoutError:
                    pass
        update = self.updates.get(key)
        if update is not None and not 0 <= body.index < len(update.have):
            raise WireError(f"{body.kind} v{body.version} of stage {self.stage} has chunks 0 to "
                            f"{len(update.have) - 1}, not {body.index}")
        if update is None or not ready():
            # Replicas are not in step: one behind asks for a version the others have dropped,
            # one ahead for a chunk nobody has yet. No fault: no strike.
            raise ChunkUnavailable(f"no chunk {body.index} of {body.kind} v{body.version} of "
                                   f"stage {self.stage} here")
        span = update.span(body.index)
        length = span.stop - span.start
        if not (0 <= body.offset < max(length, 1) and 0 <= body.count <= length - body.offset):
            raise WireError(f"chunk {body.index} of {body.kind} v{body.version} has {length} "
                            f"bytes: no piece of {body.count} from {body.offset}")
        start = span.start + body.offset
        data = bytearray(update.data[start:start + (body.count or length - body.offset)])
        count_bytes(update.sent, request.sender, len(data))
        count_bytes(self.sent_total, request.sender, len(data))
        return Reply(Empty(), {"data": torch.frombuffer(data, dtype=torch.uint8)})

    async def add(self, update: StoredUpdate) -> None:
        self.updates[update.key] = update
        self.updates.move_to_end(update.key)
        await self._notify()

    async def _notify(self) -> None:
        condition = self._condition()
        async with condition:
            condition.notify_all()

    def traffic(self) -> list[TrafficRow]:
        """Bytes sent and received, per update held and per peer (updates dropped are gone)."""
        rows = []
        for (kind, version), update in list(self.updates.items()):
            for peer in sorted(set(update.sent) | set(update.received)):
                rows.append(TrafficRow(kind, version, peer, update.sent[peer],
                                       update.received[peer]))
        return rows

    def close(self) -> None:
        self.node.unserve(SYNC_CHUNK)


class ChunkUnavailable(DecentrlError, RuntimeError):
    """A well-formed chunk request this peer cannot answer (it does not hold that update, or
    not that chunk yet): refused without a strike."""
