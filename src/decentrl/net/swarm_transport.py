"""The rollout half of the transport interface (net/transport.py) over hivemind: rollout groups
travel by RPC to the coordinator's inbox. Same methods and semantics as the in-process
`LocalTransport`; every blocking call has a timeout. Stage weights travel on their own protocol,
as compressed updates that replicas spread among themselves (sync/distribute.py).

Rollouts: the coordinator's transport owns a bounded inbox, filled by the coordinator's own
generation loops (`put_rollouts` queues directly). It does not serve `submit_rollouts`: a run
leases no problem to a remote submitter today, so every group another peer sent was refused
after it was read whole (up to submission_bytes per stream, 32 streams per sender, any
number of senders). Unserved, a submission is refused by the p2p daemon when its stream opens,
before any of it reaches this process. A run that leases work to remote submitters serves the
inbox again, with its own admission. Any other process's `put_rollouts` submits to the run's
owner."""

from __future__ import annotations

import queue
import threading

from decentrl.net.node import SwarmNode
from decentrl.net.protocol import SUBMIT_ROLLOUTS
from decentrl.net.transport import TransportClosed
from decentrl.rollout.types import RolloutGroup


class HivemindTransport:
    def __init__(self, node: SwarmNode, owner: str, *, inbox_size: int = 0,
                 timeout_s: float = 60.0) -> None:
        """`owner`: the peer id of the run's owner, whose inbox takes the rollouts.
        `inbox_size` > 0 makes this the coordinator's transport (it receives rollouts)."""
        self.node, self.owner = node, owner
        self.timeout_s = timeout_s
        self._inbox: queue.Queue[RolloutGroup] | None = (
            queue.Queue(maxsize=inbox_size) if inbox_size > 0 else None)
        self._closed = threading.Event()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")

    # ---- rollouts -------------------------------------------------------------------------

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

