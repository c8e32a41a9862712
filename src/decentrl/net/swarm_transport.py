"""The rollout half of the transport interface (net/transport.py) over hivemind: rollout groups
travel by RPC to the coordinator's inbox. Same methods and semantics as the in-process
`LocalTransport`; every blocking call has a timeout. Stage weights travel on their own protocol,
as compressed updates that replicas spread among themselves (sync/distribute.py).

Rollouts: the coordinator's transport owns a bounded inbox and serves `submit_rollouts`; any other
process's `put_rollouts` finds the coordinator's inbox record in the DHT and submits there (a
group is decoded strictly, then queued; a full inbox answers "not queued" so the sender can retry
later). In the coordinator's own process `put_rollouts` queues directly."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from decentrl.net.node import Reply, Request, SwarmNode
from decentrl.net.protocol import SUBMIT_ROLLOUTS, InboxRecord, RolloutsQueued, inbox_key
from decentrl.net.records import decode_records
from decentrl.net.transport import TransportClosed
from decentrl.net.wire import encode_struct
from decentrl.rollout.types import RolloutGroup


def find_inbox(node: SwarmNode, run: str, timeout: float) -> str | None:
    """The peer id of `run`'s inbox, or None while none is announced. The inbox is the writer
    of an inbox record that names itself (a record naming another peer is not its writer's to
    make). Raises RuntimeError if several peers announce one: anyone can sign an inbox record
    of their own, and until the run's owner is known none of them can be chosen."""
    entries = node.run(node.lookup(inbox_key(run)), timeout=timeout)
    records, _ = decode_records(entries, InboxRecord)
    inboxes = [writer for writer, record in records.items() if record.peer_id == writer]
    if len(inboxes) > 1:
        raise RuntimeError(f"{len(inboxes)} peers announce an inbox for run {run!r}: cannot "
                           "tell which is the coordinator's")
    return inboxes[0] if inboxes else None


class HivemindTransport:
    def __init__(self, node: SwarmNode, run: str, *, inbox_size: int = 0,
                 timeout_s: float = 60.0, announce_ttl_s: float = 10.0,
                 admit: Callable[[RolloutGroup, str], None] | None = None) -> None:
        """`inbox_size` > 0 makes this the coordinator's transport (it receives rollouts).
        `admit(group, sender)` decides whether another peer's submission may enter; it raises
        a ValueError naming the reason if not (None: everything well formed enters)."""
        self.node, self.run = node, run
        self.admit = admit
        self.timeout_s, self.ttl_s = timeout_s, announce_ttl_s
        self._inbox: queue.Queue[RolloutGroup] | None = (
            queue.Queue(maxsize=inbox_size) if inbox_size > 0 else None)
        self._closed = threading.Event()
        if self._inbox is not None:
            node.serve(SUBMIT_ROLLOUTS, self._serve_rollouts)
            self.announce_inbox()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")

    # ---- rollouts -------------------------------------------------------------------------

    def announce_inbox(self) -> None:
        """(Re-)announce where rollouts go; the coordinator calls this periodically."""
        self.node.run(self.node.announce(inbox_key(self.run),
                                         encode_struct(InboxRecord(peer_id=self.node.peer_id)),
                                         self.ttl_s), timeout=self.timeout_s)

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
        coordinator = find_inbox(self.node, self.run, timeout)
        if coordinator is None:
            return False
        reply, _ = self.node.call_sync(coordinator, SUBMIT_ROLLOUTS, group, timeout=timeout)
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

