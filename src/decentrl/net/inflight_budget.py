"""The bytes of request bodies a node holds at once, across all senders.

A node reads a request whole before it decodes it (its signature covers all of it), and the
per-sender cap on open streams (net/serving.py MAX_STREAMS_PER_SENDER) does not bound many senders
together: identities are free. Each message of a request takes its bytes from this budget when
its header is in, before any of it is read (net/streams.py FrameReader), and gives them back when
the request's stream ends. A message that does not fit is refused as `NodeBusy`: the node is
busy, not the sender at fault, so no strike, and what the node holds already is untouched."""

from __future__ import annotations

from decentrl.errors import DecentrlError

# A request is at most TensorLimits.max_total_bytes (1 GiB, for large runs), but at the default
# model and batch a training step's activations are tens of MiB: this holds several of them at
# once, and caps what any number of senders make a node hold.
MAX_INFLIGHT_REQUEST_BYTES = 256 * 2**20


class NodeBusy(DecentrlError, RuntimeError):
    """A request refused because the node holds its budget of request bytes already."""


class InflightBudget:
    """Bytes of requests in flight at one node, at most `limit`. Used on the node's loop only."""

    def __init__(self, limit: int = MAX_INFLIGHT_REQUEST_BYTES) -> None:
        if limit < 1:
            raise ValueError(f"an in-flight budget of {limit} bytes holds nothing")
        self.limit = limit
        self.held = 0
        self.refused = 0  # messages refused for want of room, since the node started

    def take(self, size: int, what: str) -> None:
        """Hold `size` more bytes for `what`; NodeBusy if they do not fit."""
        if self.held + size > self.limit:
            self.refused += 1
            raise NodeBusy(f"{what}: this node is busy, it holds {self.held} bytes of requests "
                           f"in flight and {size} more would pass its budget of {self.limit}; "
                           "try again later")
        self.held += size

    def give_back(self, size: int) -> None:
        self.held -= size
