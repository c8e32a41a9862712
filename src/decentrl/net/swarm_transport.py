"""The transport interface (net/transport.py) over hivemind: rollout groups travel by RPC to the
coordinator's inbox, stage weights are announced in the DHT and downloaded from the peer that
published them. Same methods and semantics as the in-process `LocalTransport`; every blocking call
has a timeout.

Rollouts: the coordinator's transport owns a bounded inbox and serves `submit_rollouts`; any other
process's `put_rollouts` finds the coordinator in the DHT and submits there (a group is decoded
strictly, then queued; a full inbox answers "not queued" so the sender can retry later). In the
coordinator's own process `put_rollouts` queues directly.

Weights: `publish_stage` keeps a private snapshot, serves it under `fetch_weights`, and announces
(stage, version) in the DHT; `fetch_stage` looks up every publisher of the stage and downloads the
newest version if it differs from the caller's. "Differs", not "is newer": a training peer that
rolls back to a checkpoint republishes an older version, and replicas must follow it."""

from __future__ import annotations

import asyncio
import queue
import threading

import torch
from hivemind.proto import runtime_pb2

from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.transport import TransportClosed
from decentrl.net.wire import (
    ActivationCodec,
    TensorManifest,
    WireError,
    decode_struct,
    encode_struct,
    encode_tensors,
)
from decentrl.rollout.types import RolloutGroup
from decentrl.swarm.protocol import (
    FetchWeights,
    InboxRecord,
    RolloutsQueued,
    WeightsRecord,
    WeightsReply,
    coordinator_key,
    weights_key,
)

COORDINATOR_SUBKEY = "inbox"


class HivemindTransport:
    def __init__(self, node: SwarmNode, run: str, *, inbox_size: int = 0,
                 weights_codec: ActivationCodec = "bf16", timeout_s: float = 60.0,
                 announce_ttl_s: float = 10.0) -> None:
        """`inbox_size` > 0 makes this the coordinator's transport (it receives rollouts)."""
        self.node, self.run = node, run
        self.weights_codec, self.timeout_s, self.ttl_s = weights_codec, timeout_s, announce_ttl_s
        self._inbox: queue.Queue[RolloutGroup] | None = (
            queue.Queue(maxsize=inbox_size) if inbox_size > 0 else None)
        self._published: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        # The encoded form of each stage's published version, made on its first fetch.
        self._encoded: dict[int, tuple[int, tuple[list[runtime_pb2.Tensor], TensorManifest]]] = {}
        self._encode_lock = asyncio.Lock()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.rejected_submissions = 0
        node.serve("fetch_weights", self._serve_weights)
        if self._inbox is not None:
            node.serve("submit_rollouts", self._serve_rollouts)
            self.announce_inbox()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")

    # ---- rollouts -------------------------------------------------------------------------

    def announce_inbox(self) -> None:
        """(Re-)announce where rollouts go; the coordinator calls this periodically."""
        self.node.run(self.node.announce(coordinator_key(self.run), COORDINATOR_SUBKEY,
                                         encode_struct(InboxRecord(peer_id=self.node.peer_id)),
                                         self.ttl_s), timeout=self.timeout_s)

    async def _serve_rollouts(self, request: Request) -> Reply:
        assert self._inbox is not None
        try:
            group = decode_struct(request.body, RolloutGroup)
        except WireError:
            self.rejected_submissions += 1
            raise
        try:
            self._inbox.put_nowait(group)
            return Reply(RolloutsQueued(queued=True))
        except queue.Full:
            return Reply(RolloutsQueued(queued=False))

    def put_rollouts(self, group: RolloutGroup, timeout: float) -> bool:
        self._check_open()
        if self._inbox is not None:
            try:
                self._inbox.put(group, timeout=timeout)
                return True
            except queue.Full:
                return False
        entries = self.node.run(self.node.lookup(coordinator_key(self.run)), timeout=timeout)
        if COORDINATOR_SUBKEY not in entries:
            return False
        coordinator = decode_struct(entries[COORDINATOR_SUBKEY], InboxRecord).peer_id
        raw, _ = self.node.call_sync(coordinator, "submit_rollouts", group, timeout=timeout)
        return decode_struct(raw, RolloutsQueued).queued

    def get_rollouts(self, timeout: float) -> RolloutGroup | None:
        self._check_open()
        if self._inbox is None:
            raise RuntimeError("only the coordinator's transport receives rollouts")
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    # ---- weights --------------------------------------------------------------------------

    def publish_stage(self, stage: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._check_open()
        # A private copy: the trainer keeps stepping its own tensors after publishing.
        snapshot = {name: t.detach().to("cpu", torch.float32, copy=True)
                    for name, t in tensors.items()}
        with self._lock:
            self._published[stage] = (version, snapshot)
        record = encode_struct(WeightsRecord(stage=stage, version=version))
        self.node.run(self.node.announce(weights_key(self.run, stage), self.node.peer_id, record,
                                         self.ttl_s), timeout=self.timeout_s)

    async def _serve_weights(self, request: Request) -> Reply:
        body = decode_struct(request.body, FetchWeights)
        with self._lock:
            published = self._published.get(body.stage)
        if published is None:
            raise WireError(f"this peer publishes no weights for stage {body.stage}")
        version, tensors = published
        async with self._encode_lock:  # replicas ask together; encode once, off the loop
            cached = self._encoded.get(body.stage)
            if cached is None or cached[0] != version:
                encoded = await asyncio.get_running_loop().run_in_executor(
                    None, encode_tensors, tensors, self.weights_codec)
                cached = self._encoded[body.stage] = (version, encoded)
        return Reply(WeightsReply(version=version), encoded=cached[1])

    def fetch_stage(self, stage: int, current_version: int
                    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        self._check_open()
        entries = self.node.run(self.node.lookup(weights_key(self.run, stage)),
                                timeout=self.timeout_s)
        publishers = []
        for peer, raw in entries.items():
            try:
                record = decode_struct(raw, WeightsRecord)
            except WireError:
                continue
            if record.stage == stage:
                publishers.append((record.version, peer))
        if not publishers:
            return None
        version, peer = max(publishers)
        if version == current_version:
            return None
        raw, tensors = self.node.call_sync(peer, "fetch_weights", FetchWeights(stage=stage),
                                           timeout=self.timeout_s)
        return decode_struct(raw, WeightsReply).version, tensors

    def republish(self) -> None:
        """Renew the DHT announcements before they expire (called periodically)."""
        with self._lock:
            published = {stage: version for stage, (version, _) in self._published.items()}
        for stage, version in published.items():
            record = encode_struct(WeightsRecord(stage=stage, version=version))
            self.node.run(self.node.announce(weights_key(self.run, stage), self.node.peer_id,
                                             record, self.ttl_s), timeout=self.timeout_s)
        if self._inbox is not None:
            self.announce_inbox()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.node.unserve("fetch_weights")
        if self._inbox is not None:
            self.node.unserve("submit_rollouts")

