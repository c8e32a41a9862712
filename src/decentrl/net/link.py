"""WAN link emulation, so one machine can stand in for peers spread over three continents.

Every RPC hop between two peers goes through an emulated `Link` on the caller's side: the caller
awaits `send(request_bytes, "out")` before the request and `send(response_bytes, "in")` before it
hands the response on. A message costs its transmission time (bytes over bandwidth, one message at
a time per direction, as on a real link) and then the one-way propagation delay (half the link's
round-trip time plus jitter); it may be lost. All randomness comes from seeded generators, so a run
with the same peers and seed sees the same links. Every wait goes through a `LinkClock` (the event
loop's by default), so a test can see the exact delays the emulator asks for without waiting."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from decentrl.errors import DecentrlError

DIRECTIONS = ("out", "in")


class LinkClock(Protocol):
    """What the emulator waits with. It never reads the time: a message's cost is a delay it
    computes up front and then waits out, so a clock is only a way to wait. A test passes one that
    records the delays asked for instead of sleeping through them."""

    async def sleep(self, seconds: float) -> None: ...


class EventLoopClock:
    """The real clock: `asyncio.sleep` on the running event loop."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


# Stateless, so every link and uplink can share it.
EVENT_LOOP_CLOCK = EventLoopClock()


class MessageLost(DecentrlError, ConnectionError):
    """The emulated link dropped a message; the caller sees it as a failed connection."""


@dataclass(frozen=True)
class LinkProfile:
    """How every link of one emulator behaves. The all-zero default is a perfect link: no sleeps."""

    # Each (local, remote) pair draws its round-trip time uniformly from this range, once.
    rtt_ms: tuple[float, float] = (0.0, 0.0)
    # Each one-way trip adds uniform noise in [0, jitter_ms].
    jitter_ms: float = 0.0
    # Megabits per second in each direction of one link; None is unlimited.
    bandwidth_mbps: float | None = None
    # Megabits per second of a peer's whole upload, shared by everything it sends to anyone (a
    # consumer uplink); None is unlimited.
    uplink_mbps: float | None = None
    # Probability that a message is lost.
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        rtt = tuple(self.rtt_ms)
        if len(rtt) != 2:
            raise ValueError(f"rtt_ms must be a (low, high) pair, got {self.rtt_ms!r}")
        low, high = float(rtt[0]), float(rtt[1])
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high):
            raise ValueError(f"rtt_ms must be finite with 0 <= low <= high, got {self.rtt_ms!r}")
        # A list from a config file becomes the tuple the type promises.
        object.__setattr__(self, "rtt_ms", (low, high))
        if not (math.isfinite(self.jitter_ms) and self.jitter_ms >= 0.0):
            raise ValueError(f"jitter_ms must be finite and >= 0, got {self.jitter_ms}")
        for name in ("bandwidth_mbps", "uplink_mbps"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0.0):
                raise ValueError(f"{name} must be None or finite and > 0, got {value}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")

    @property
    def enabled(self) -> bool:
        """False for a perfect link, on which `Link.send` only counts and never sleeps."""
        return (self.rtt_ms[1] > 0.0 or self.jitter_ms > 0.0 or self.bandwidth_mbps is not None
                or self.uplink_mbps is not None or self.loss > 0.0)

    def rtt_seconds(self, peer_a: str, peer_b: str) -> float:
        """The round-trip time of the link between two peers. The same whichever side asks, and
        the same in every process and run: it hashes the seed and the sorted names (Python's
        `hash` of a string changes from process to process)."""
        low, high = self.rtt_ms
        first, second = sorted((peer_a, peer_b))
        return (low + _unit(self.seed, "rtt", first, second) * (high - low)) / 1000.0


def _unit(seed: int, *keys: str) -> float:
    """A number in [0, 1) fixed by the seed and the keys."""
    data = "\0".join((str(seed), *keys)).encode()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass
class LinkStats:
    """What one link carried. Lost messages count in the bytes and messages too: they were sent."""

    bytes_out: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    messages_in: int = 0
    lost: int = 0


class Link:
    """The emulated link between `local` and `remote`, used from the local side for both ways."""

    def __init__(self, local: str, remote: str, profile: LinkProfile,
                 clock: LinkClock = EVENT_LOOP_CLOCK) -> None:
        if local == remote:
            raise ValueError(f"peer {local!r} has no link to itself")
        self.local = local
        self.remote = remote
        self.profile = profile
        self.clock = clock
        self.rtt_s = profile.rtt_seconds(local, remote)
        self.stats = LinkStats()
        # Seeded per ordered pair, so each side's draws are reproducible on their own.
        self._rng = random.Random(int(_unit(profile.seed, "rng", local, remote) * 2**53))
        # One transmission at a time per direction (links are full duplex). Locks are made per
        # event loop, so a link outlives an `asyncio.run` without a "bound to a different event
        # loop" error.
        self._locks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Lock]] = {}

    def _lock(self, direction: str) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        held = self._locks.get(direction)
        if held is None or held[0] is not loop:
            held = (loop, asyncio.Lock())
            self._locks[direction] = held
        return held[1]

    async def send(self, nbytes: int, direction: str = "out") -> None:
        """Carry one message of `nbytes` across the link: wait for the link to be free, transmit,
        then propagate. Raises MessageLost after the propagation delay if the message is lost,
        as the sender of a real lost message learns nothing sooner."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if direction == "out":
            self.stats.bytes_out += nbytes
            self.stats.messages_out += 1
        else:
            self.stats.bytes_in += nbytes
            self.stats.messages_in += 1
        profile = self.profile
        if not profile.enabled:
            return
        # Draw everything up front, so the sequence of draws does not depend on task scheduling.
        delay = self.rtt_s / 2.0 + self._rng.uniform(0.0, profile.jitter_ms) / 1000.0
        lost = self._rng.random() < profile.loss
        if profile.bandwidth_mbps is not None and nbytes > 0:
            # Only the transmission holds the lock: concurrent messages pipeline behind each other
            # and then propagate side by side.
            async with self._lock(direction):
                await self.clock.sleep(nbytes * 8 / (profile.bandwidth_mbps * 1e6))
        if delay > 0.0:
            await self.clock.sleep(delay)
        if lost:
            self.stats.lost += 1
            raise MessageLost(f"emulated link {self.local} -> {self.remote} lost a {direction} "
                              f"message of {nbytes} bytes")


class Uplink:
    """A peer's upload at `uplink_mbps`, shared by everything it sends to anyone. Requests pass it
    on the caller's side and replies on the server's, so a peer serving many others splits one
    uplink among them, as at home. One message is on the wire at a time, and waiting messages
    take turns by destination (round robin), as concurrent TCP flows share a link: a peer that
    asked once is not queued behind every message of a peer that asked many times."""

    def __init__(self, mbps: float | None, clock: LinkClock = EVENT_LOOP_CLOCK) -> None:
        self.mbps = mbps
        self.clock = clock
        self.bytes_sent = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._busy = False
        self._last_served: str | None = None

    async def send(self, nbytes: int, destination: str) -> None:
        self.bytes_sent += nbytes
        if self.mbps is None or nbytes <= 0:
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(destination, deque()).append(turn)
        if not self._busy:
            self._next_turn()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._busy = False  # our turn came as we were cancelled: pass it on
                self._next_turn()
            raise
        try:
            await self.clock.sleep(nbytes * 8 / (self.mbps * 1e6))
        finally:
            self._busy = False
            self._next_turn()

    def _next_turn(self) -> None:
        """Give the wire to the first live message of the next destination in turn."""
        while self._waiting and not self._busy:
            destination = next(iter(self._waiting))
            if destination == self._last_served and len(self._waiting) > 1:
                self._waiting.move_to_end(destination)  # the others go first
                destination = next(iter(self._waiting))
            queue = self._waiting[destination]
            turn = queue.popleft()
            if queue:
                self._waiting.move_to_end(destination)
            else:
                del self._waiting[destination]
            if not turn.cancelled():
                self._busy, self._last_served = True, destination
                turn.set_result(None)


@dataclass
class LinkEmulator:
    """The links from one local peer to every remote it talks to, all with the same profile."""

    local: str
    profile: LinkProfile = field(default_factory=LinkProfile)
    clock: LinkClock = field(default=EVENT_LOOP_CLOCK, repr=False)
    _links: dict[str, Link] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.uplink = Uplink(self.profile.uplink_mbps, self.clock)

    def link(self, remote: str) -> Link:
        """The link to `remote`, created on first use."""
        link = self._links.get(remote)
        if link is None:
            link = Link(self.local, remote, self.profile, self.clock)
            self._links[remote] = link
        return link

    def stats(self) -> dict[str, LinkStats]:
        """A snapshot of every link's counters, by remote peer."""
        return {remote: replace(link.stats) for remote, link in self._links.items()}

    def total_bytes(self) -> int:
        """Bytes carried in both directions over all links, lost messages included."""
        return sum(link.stats.bytes_out + link.stats.bytes_in for link in self._links.values())
