"""Connections through a relay, and what each may still carry.

A circuit relay (libp2p relay v2) is meant to bridge two peers that cannot dial each other, not
to carry their traffic: each relayed connection may move at most 128 KiB in each direction and
live 2 minutes, after which the relay resets it (go-libp2p's defaults). Relays run by strangers
use those defaults, and so do ours: p2pd registers a relay with the defaults beside the one it
is configured with, and whichever registers last serves (NOTES.md, issue #19).

So a node keeps, for each peer it reaches through a relay (it dialed the peer through one, or
the peer's requests come in through one), a `Circuit`: when the connection opened and the bytes
it carried each way. A call to that peer starts only where the connection has room for the
request and for `REPLY_ROOM` of reply beside the calls in flight; otherwise it waits for those
to finish, and the node closes the connection and dials a fresh circuit first (`take_room`;
net/calls.py makes the call, net/routing.py dials).
Replies that may be larger are asked for in pieces of at most `PIECE_BYTES` (weight-sync
chunks, sync/distribute.py, and checkpoint shards); one that still does not fit is cut by the
relay, and the call fails like any lost reply."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from decentrl.errors import DecentrlError
from decentrl.net.reach import through_relay

# Of the relay's 128 KiB and 2 minutes: the rest is left for what is not counted here (stream
# framing, encryption, identify, DHT requests on the same connection).
CIRCUIT_BYTES = 100 * 2**10
CIRCUIT_AGE_S = 100.0
# The reply a call over a circuit keeps room for, and the data a reply should carry at most so
# that it fits with its envelope (signature, tensor manifest).
REPLY_ROOM = 48 * 2**10
PIECE_BYTES = 40 * 2**10
# Peers remembered: identities are free, and an honest swarm has tens of peers.
MAX_CIRCUITS = 1024


class CircuitTooSmall(DecentrlError, ConnectionError):
    """A request larger than a relayed connection carries at all."""


@dataclass
class Circuit:
    """The relayed connection to one peer: its address, age, the bytes it carried each way and
    those that calls in flight on it may still add. A call starts only where the connection has
    room for it (so a few go at once); one that does not fit waits until the calls in flight
    are done and then replaces the connection. `changed` is kept when the connection is
    replaced, so that calls waiting for the old one wait for the new one."""

    address: str
    opened: float
    sent: int = 0
    received: int = 0
    reserved_sent: int = 0
    reserved_received: int = 0
    in_flight: int = 0
    # A call over it failed (the relay may have cut it): replaced before the next call.
    broken: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def has_room(self, request_bytes: int, reply_bytes: int) -> bool:
        return not self.broken and time.monotonic() - self.opened < CIRCUIT_AGE_S \
            and self.sent + self.reserved_sent + request_bytes <= CIRCUIT_BYTES \
            and self.received + self.reserved_received + reply_bytes <= CIRCUIT_BYTES

    def reserve(self, request_bytes: int, reply_bytes: int) -> None:
        self.reserved_sent += request_bytes
        self.reserved_received += reply_bytes
        self.in_flight += 1

    def settle(self, request_bytes: int, reply_bytes: int, sent: int, received: int) -> None:
        """A call that reserved (`request_bytes`, `reply_bytes`) is done: it carried (`sent`,
        `received`)."""
        self.reserved_sent -= request_bytes
        self.reserved_received -= reply_bytes
        self.in_flight -= 1
        self.sent += sent
        self.received += received

    async def take_room(self, peer: str, method: str, request_bytes: int, reply_bytes: int,
                        connections: Callable[[], Awaitable[tuple[bool, bool]]],
                        renew: Callable[[], Awaitable[None]]) -> bool:
        """Room for a call to `peer` on this connection: False once it is reserved (after the
        calls in flight left room, or on a fresh connection, `renew`); True, nothing reserved,
        if the daemon holds a direct connection to `peer` by now (`connections`: whether it
        holds a direct one and a relayed one), which the call takes instead. CircuitTooSmall if
        the request is more than a relayed connection carries at all."""
        # What the daemon holds is asked under the lock: a renewal by another call in between
        # would otherwise be taken for the connection the peer closed, and replaced again under
        # that call.
        async with self.changed:
            direct, connected = await connections()
            if not direct and request_bytes > CIRCUIT_BYTES:
                raise CircuitTooSmall(
                    f"{method}: a request of {request_bytes} bytes is more than a relayed "
                    f"connection carries ({CIRCUIT_BYTES}), and {peer[-8:]} is reached "
                    "through a relay")
            while not direct and not self.has_room(request_bytes, reply_bytes) \
                    and self.in_flight:
                await self.changed.wait()  # calls in flight end within their timeout
                direct, connected = await connections()
            if direct:
                return True
            if not connected or not self.has_room(request_bytes, reply_bytes):
                # Full or old; or closed by the peer (it renews it too, by its own count): dial
                # the relay now, before the daemon spends seconds dialing the peer's own
                # addresses, which only its LAN can reach.
                await renew()
            self.reserve(request_bytes, reply_bytes)
            return False

    async def release(self, request_bytes: int, reply_bytes: int, sent: int,
                      received: int) -> None:
        """`settle`, and wake the calls that wait for room."""
        async with self.changed:
            self.settle(request_bytes, reply_bytes, sent, received)
            self.changed.notify_all()

    def renewed(self, address: str) -> None:
        """A fresh connection (through `address`) took this one's place."""
        self.address = address
        self.opened = time.monotonic()
        self.sent = self.received = 0
        self.broken = False


class Circuits:
    """The circuits of one node, by peer (changed on its event loop only)."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str, Circuit] = OrderedDict()
        # Connections replaced before they ran out, and calls over a circuit that failed.
        self.renewals = 0
        self.failures = 0
        # Of what this node sent (requests to peers it reached through a relay, replies to
        # requests that came through one), the bytes that crossed a relay.
        self.relayed_bytes_sent = 0

    def get(self, peer: str) -> Circuit | None:
        return self._by_peer.get(peer)

    def opened(self, peer: str, address: str) -> Circuit:
        """A connection to `peer` through a relay at `address` is new (this node dialed it or
        `peer`'s first request came through it)."""
        circuit = self._by_peer.get(peer)
        if circuit is None:
            circuit = self._by_peer[peer] = Circuit(address, time.monotonic())
            while len(self._by_peer) > MAX_CIRCUITS:
                self._by_peer.popitem(last=False)
        else:
            circuit.renewed(address)
        self._by_peer.move_to_end(peer)
        return circuit

    def seen(self, peer: str, address: str, received: int, sent: int) -> None:
        """A request of `peer`'s came in over `address` (`received` bytes; `sent` in reply). A
        direct connection ends the circuit's bookkeeping: new streams prefer it."""
        if not through_relay(address):
            self._by_peer.pop(peer, None)
            return
        circuit = self._by_peer.get(peer) or self.opened(peer, address)
        circuit.received += received
        circuit.sent += sent

    def forget(self, peer: str) -> None:
        self._by_peer.pop(peer, None)

    def piece_bytes(self, peer: str) -> int | None:
        """The data a reply from `peer` should carry at most (None: any size, not relayed).
        One lookup, so any thread may ask."""
        return PIECE_BYTES if peer in self._by_peer else None
