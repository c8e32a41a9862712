"""Evidence of a peer's malformed push, kept by the peer it was pushed to.

Activations travel from stage to stage (stage/push.py), so when stage k pushes something stage
k+1 must refuse (hidden states of the wrong width, non-finite or absurd values), the coordinator
is not there to see it, and stage k can claim that k+1 failed. But stage k signed what it sent
(net/signing.py: every request's body, manifest and tensors), so k+1 keeps that signed request,
as it came, and hands it to the coordinator when asked (`evidence`, the owner's RPC). The
coordinator checks the signature against k's key and the content against the checks k+1 ran
(trust/evidence.py): a request k signed that fails them is proof against k, whoever shows it.

Bounded as everything a peer keeps for others: only requests of RPCs whose callers are "the
previous stage" are kept (a stranger's junk is struck, not filed), `MAX_PER_SENDER` of a sender
and `MAX_ITEMS`, `MAX_BYTES` in all, the oldest dropped first, each for `KEEP_S`."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from hivemind.proto import runtime_pb2

from decentrl.net.wire import Body

MAX_PER_SENDER = 2
MAX_ITEMS = 16
MAX_BYTES = 128 * 1024 * 1024
KEEP_S = 900.0


class SignedCopy(Body):
    """A refused request as its sender signed it: the envelope (encoded), the tensor parts
    (serialized protobufs), why it was refused here."""

    method: str
    request_id: str
    envelope: bytes
    parts: list[bytes]
    refusal: str

    @property
    def nbytes(self) -> int:
        return len(self.envelope) + sum(len(part) for part in self.parts)


class EvidenceRequest(Body):
    sender: str  # whose refused requests
    method: str


class EvidenceReply(Body):
    copies: list[SignedCopy]


class EvidenceLocker:
    """The refused requests this peer keeps, by (sender, method), newest last."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str, str], tuple[float, SignedCopy]] = OrderedDict()

    def keep(self, sender: str, method: str, request_id: str, envelope: bytes,
             parts: Sequence[runtime_pb2.Tensor], refusal: str) -> None:
        copy = SignedCopy(method, request_id, envelope,
                          [part.SerializeToString() for part in parts], refusal[:500])
        with self._lock:
            self._expire()
            key = (sender, method, request_id)
            self._items.pop(key, None)
            mine = [k for k in self._items if k[:2] == (sender, method)]
            for old in mine[:max(0, len(mine) + 1 - MAX_PER_SENDER)]:
                del self._items[old]
            self._items[key] = (self.clock(), copy)
            while len(self._items) > MAX_ITEMS or self._bytes() > MAX_BYTES:
                self._items.popitem(last=False)

    def copies(self, sender: str, method: str) -> list[SignedCopy]:
        with self._lock:
            self._expire()
            return [copy for key, (_, copy) in self._items.items() if key[:2] == (sender, method)]

    def _bytes(self) -> int:
        return sum(copy.nbytes for _, copy in self._items.values())

    def _expire(self) -> None:
        horizon = self.clock() - KEEP_S
        for key in [k for k, (kept, _) in self._items.items() if kept < horizon]:
            del self._items[key]
