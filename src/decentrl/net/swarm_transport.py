"""The rollout half of the transport interface (net/transport.py) over hivemind: rollout groups
travel by RPC to the coordinator's inbox. Same methods and semantics as the in-process
`LocalTransport`; every blocking call has a timeout. Stage weights travel on their own protocol,
as compressed updates that replicas spread among themselves (sync/distribute.py).

Rollouts: the coordinator's transport owns a bounded inbox and serves `submit_rollouts`; any other
process's `put_rollouts` submits to the run's owner, which is the coordinator (a group is decoded
strictly, then queued; a full inbox answers "not queued" so the sender can retry later). In the
coordinator's own process `put_rollouts` queues directly."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import SUBMIT_ROLLOUTS, RolloutsQueued
from decentrl.net.transport import TransportClosed
from decentrl.rollout.types import RolloutGroup


class HivemindTransport:
    def __init__(self, node: SwarmNode, owner: str, *, inbox_size: int = 0,
                 timeout_s: float = 60.0,
                 admit: Callable[[RolloutGroup, str], None] | None = None) -> None:
        """`owner`: the peer id of the run's owner, whose inbox takes the rollouts.
        `inbox_size` > 0 makes this the coordinator's transport (it receives rollouts).
        `admit(group, sender)` decides whether another peer's submission may enter; it raises
        a ValueError naming the reason if not (None: everything well formed enters)."""
        self.node, self.owner = node, owner
        self.admit = admit
        self.timeout_s = timeout_s
        self._inbox: queue.Queue[RolloutGroup] | None = (
            queue.Queue(maxsize=inbox_size) if inbox_size > 0 else None)
        self._closed = threading.Event()
        if self._inbox is not None:
            node.serve(SUBMIT_ROLLOUTS, self._serve_rollouts)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")

    # ---- rollouts -------------------------------------------------------------------------

    async def _serve_rollouts(self, request: Request[RolloutGroup]) -> Reply:
        assert self._inbox is not None
        group = request.body
        if self.admit is not None:
            self.admit(group, request.sender)  # its ValueError is a strike against the sender
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
        reply, _ = self.node.call_sync(self.owner, SUBMIT_ROLLOUTS, group, timeout=timeout)
        return reply.queued

    def get_rollouts(self, timeout: float) -> RolloutGroup | None:
        self._check_open()
        if self._inbox is None:
            raise RuntimeError("only the coordinator's transport receives rollouts")
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._inbox is not None:
            self.node.unserve(SUBMIT_ROLLOUTS)

