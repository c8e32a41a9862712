"""Links between simulated peers: every endpoint's uplink and downlink are queues that a message
holds for its bytes' serialisation time, a frame at a time (so messages sharing a pipe take
turns, as streams multiplexed on a connection do), and between them the one-way delay of the
pair's round trip. A pair that are both behind NAT go through a relay, as net/reach.py
and net/circuits.py route them: a longer round trip and go-libp2p's window per relayed
connection, which caps such a flow at window / round trip. A message's software work (encoding,
signatures, the p2p daemons) runs on the cores of its ends where they share a host's cores with
compute, and only delays it elsewhere. Bytes are counted per endpoint and direction, so the run
reports what each peer and the coordinator sent and received."""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from decentrl.sim.scenario import LinkSpec


@dataclass
class Endpoint:
    """One party's network side: where it is, whether it is behind NAT, its pipes."""

    name: str
    region: str
    behind_nat: bool
    uplink_bps: float
    downlink_bps: float
    uplink: simpy.Resource
    downlink: simpy.Resource
    sent: int = 0
    received: int = 0
    relayed_bytes: int = 0  # bytes it sent through a relay
    busy_up_s: float = 0.0  # seconds its uplink spent serialising
    busy_down_s: float = 0.0
    messages: int = 0  # messages it sent
    extra: dict[str, float] = field(default_factory=dict)
    # The cores its messages' software work runs on, where they are shared with compute (a
    # host of the loopback demo); None: that work only delays the message.
    cpu: simpy.PriorityResource | None = None
    cpu_s: float = 0.0  # seconds of it spent on messages


# The bytes a pipe carries of one message before another message's turn (yamux's window per
# stream is 256 KiB; a coarser frame keeps the event count down).
FRAME_BYTES = 1 << 20


class Network:
    def __init__(self, env: simpy.Environment, links: LinkSpec, seed: int) -> None:
        self.env, self.links = env, links
        self.random = random.Random(seed)
        self.endpoints: dict[str, Endpoint] = {}

    def endpoint(self, name: str, region: str, behind_nat: bool, uplink_mbps: float,
                 downlink_mbps: float) -> Endpoint:
        if name in self.endpoints:
            raise ValueError(f"endpoint {name!r} exists already")
        found = Endpoint(name, region, behind_nat, uplink_mbps * 1e6, downlink_mbps * 1e6,
                         simpy.Resource(self.env, 1), simpy.Resource(self.env, 1))
        self.endpoints[name] = found
        return found

    def relayed(self, source: Endpoint, target: Endpoint) -> bool:
        """Neither can accept the other's connection: both are behind NAT."""
        return source.behind_nat and target.behind_nat

    def round_trip_s(self, source: Endpoint, target: Endpoint) -> float:
        rtt = self.links.rtt_s(source.region, target.region)
        if self.relayed(source, target):
            rtt += self.links.relay_extra_rtt_ms / 1000.0
        if self.links.jitter_ms:
            rtt += abs(self.random.gauss(0.0, self.links.jitter_ms / 1000.0))
        return rtt

    def send(self, source: Endpoint, target: Endpoint, nbytes: int) -> Generator[Any, Any, None]:
        """A message of `nbytes` from `source` to `target`, delivered when this returns: it
        streams through the sender's uplink and the receiver's downlink at once (each a queue
        shared with their other messages), then takes half the round trip."""
        if nbytes < 0:
            raise ValueError(f"a message cannot have {nbytes} bytes")
        env = self.env
        rtt = self.round_trip_s(source, target)
        serialise, receive = nbytes * 8 / source.uplink_bps, nbytes * 8 / target.downlink_bps
        # Frame by frame: the messages sharing a pipe take turns, as streams multiplexed on a
        # connection do, so a small one is not stuck behind a keyframe.
        for frame in range(0, max(nbytes, 1), FRAME_BYTES):
            size = min(FRAME_BYTES, nbytes - frame)
            yield env.process(self._hold(source.uplink, size * 8 / source.uplink_bps)) \
                & env.process(self._hold(target.downlink, size * 8 / target.downlink_bps))
        source.busy_up_s += serialise
        target.busy_down_s += receive
        if self.relayed(source, target):
            # The relay lets one window through per round trip.
            capped = nbytes / (self.links.relay_window_bytes / rtt)
            if capped > max(serialise, receive):
                yield env.timeout(capped - max(serialise, receive))
            source.relayed_bytes += nbytes
        yield env.timeout(rtt / 2)
        # Encoding, signing, the daemons: half at each end.
        overhead = (self.links.message_overhead_ms / 1000.0
                    + self.links.message_overhead_s_per_byte * nbytes) / 2
        yield from self._software(source, overhead)
        yield from self._software(target, overhead)
        source.sent += nbytes
        source.messages += 1
        target.received += nbytes

    def _software(self, endpoint: Endpoint, seconds: float) -> Generator[Any, Any, None]:
        if seconds <= 0:  # none measured (the projections): no event to schedule
            return
        if endpoint.cpu is None:
            yield self.env.timeout(seconds)
            return
        with endpoint.cpu.request(priority=0) as turn:
            yield turn
            yield self.env.timeout(seconds)
        endpoint.cpu_s += seconds

    def _hold(self, pipe: simpy.Resource, seconds: float) -> Generator[Any, Any, None]:
        with pipe.request() as turn:
            yield turn
            yield self.env.timeout(seconds)
