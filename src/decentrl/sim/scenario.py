"""What a simulated run is made of: the run's own config (the same RunConfig a real run reads, so
the simulated policies take the same fields), the model's shape, the peers with their hardware,
regions and NAT, the coordinator's link and CPU, and the workload the config does not say (prompt
and completion lengths, the share of groups with reward spread, churn, adversaries).

`data_plane` switches the design of the inference and training chains: "coordinator" (today's:
every activation goes through the coordinator, client/sessions.py, coordinator/swarm_backend.py)
or "peer_to_peer" (issue #36: activations go from one stage's peer to the next's; the coordinator
sends token ids to stage 0 and gets tokens, log-probs and sketches back)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from decentrl.config import RunConfig
from decentrl.sim.costs import CHECKPOINT_S_PER_BYTE, SAMPLING_S_PER_LOGIT, Speed
from decentrl.sim.hardware import HardwareProfile
from decentrl.sim.machines import HARDWARE
from decentrl.sim.shapes import ModelShape

Role = Literal["inference", "training"]
DataPlane = Literal["coordinator", "peer_to_peer"]


@dataclass(frozen=True)
class PeerSpec:
    """One peer: its stage and role, its hardware (a key of sim/hardware.py HARDWARE, or a
    profile), where it is, and how long it stays."""

    name: str
    stage: int
    role: Role
    hardware: str | HardwareProfile
    region: str
    behind_nat: bool = False
    # The peers of one machine share its cores (the loopback demo): a host name and its cores.
    host: str | None = None
    # Seconds until it leaves (churn); None: it stays for the whole run.
    leaves_at_s: float | None = None
    # A liar: its groups are bad; a spot check that re-executes one bans it.
    adversary: bool = False
    # Multiplies its hardware's throughput per kind of work (sim/calibration.py).
    speed: Speed = Speed()
    # Its own access link (Mbit/s); None: the scenario's LinkSpec default.
    uplink_mbps: float | None = None
    downlink_mbps: float | None = None

    def profile(self) -> HardwareProfile:
        return self.hardware if isinstance(self.hardware, HardwareProfile) \
            else HARDWARE[self.hardware]


@dataclass(frozen=True)
class LinkSpec:
    """Round trips between regions (ms, symmetric; a region to itself included), each peer's
    uplink and downlink (Mbit/s), and the relays NAT'd pairs go through."""

    rtt_ms: Mapping[tuple[str, str], float]
    uplink_mbps: float = 20.0
    downlink_mbps: float = 100.0
    # A relayed connection: go-libp2p's limits as net/circuits.py keeps them (128 KiB in flight
    # each way), and the detour through the relay's region.
    relay_window_bytes: int = 128 * 2**10
    relay_extra_rtt_ms: float = 40.0
    jitter_ms: float = 0.0
    # Software time per message beyond the link: encoding, signatures, the p2p daemons; a fixed
    # part and a part per byte (sim/calibration.py hop_overhead measures both on loopback).
    message_overhead_ms: float = 0.0
    message_overhead_s_per_byte: float = 0.0

    def rtt_s(self, a: str, b: str) -> float:
        found = self.rtt_ms.get((a, b), self.rtt_ms.get((b, a)))
        if found is None:
            raise ValueError(f"no round trip between regions {a!r} and {b!r}")
        return found / 1000.0


@dataclass(frozen=True)
class CoordinatorSpec:
    region: str
    uplink_mbps: float = 100.0
    downlink_mbps: float = 100.0
    cpu_cores: int = 4
    # Its CPU per relayed message and per relayed byte (checks, sketches, signatures), and per
    # group ingested (rewards, store): calibrated on this machine (bench/simulate.py).
    seconds_per_message: float = 2e-4
    seconds_per_byte: float = 2e-9
    seconds_per_group: float = 2e-3
    host: str | None = None  # shares a host's cores with peers (the loopback demo)


@dataclass(frozen=True)
class Workload:
    """What the config leaves to the task and the model."""

    prompt_tokens: int = 40
    # A row's completion length as a share of max_new_tokens (uniform in [low, high]).
    completion_share: tuple[float, float] = (0.3, 1.0)
    # The share of groups with reward spread (dynamic_sampling and zero-variance groups keep only
    # those): the sums demo's curriculum measured about 0.7.
    spread_share: float = 0.7


@dataclass(frozen=True)
class Kill:
    """A peer killed at `at_s` and serving again `back_after_s` later (`decentrl demo --chaos`:
    launch/local_swarm.py `chaos` restarts it under the same name; a training peer comes back
    from its last checkpoint)."""

    at_s: float
    peer: str
    back_after_s: float | None  # None: it did not come back


@dataclass(frozen=True)
class Scenario:
    config: RunConfig
    shape: ModelShape
    peers: tuple[PeerSpec, ...]
    coordinator: CoordinatorSpec
    links: LinkSpec
    workload: Workload = Workload()
    data_plane: DataPlane = "coordinator"
    duration_s: float = 720.0
    seed: int = 0
    host_cores: Mapping[str, int] = field(default_factory=dict)
    # Churn: a replica that leaves is replaced this many seconds later by a fresh one on the
    # same machine and stage (a new identity), which first fetches the stage's weights, then
    # serves for as long as the one before it did. None: nobody replaces it.
    rejoin_after_s: float | None = None
    # At each (seconds, peers, Mbit/s), those peers' uplinks change to that rate (a home's link
    # throttled mid-run, launch/throttle.py).
    uplink_changes: tuple[tuple[float, tuple[str, ...], float], ...] = ()
    # The peers' CPU seconds of sampling per logit (sim/costs.py SAMPLING_S_PER_LOGIT).
    sampling_s_per_logit: float = SAMPLING_S_PER_LOGIT
    kills: tuple[Kill, ...] = ()
    # A training peer's seconds per byte of checkpoint (sim/costs.py CHECKPOINT_S_PER_BYTE).
    checkpoint_s_per_byte: float = CHECKPOINT_S_PER_BYTE

    def __post_init__(self) -> None:
        stages = self.config.num_stages
        for role in ("inference", "training"):
            missing = [s for s in range(stages)
                       if not any(p.stage == s and p.role == role for p in self.peers)]
            if missing:
                raise ValueError(f"stages {missing} have no {role} peer")
        if len({p.name for p in self.peers}) != len(self.peers):
            raise ValueError("peer names must be distinct")
        for peer in self.peers:
            if not 0 <= peer.stage < stages:
                raise ValueError(f"peer {peer.name}: stage {peer.stage} outside 0..{stages - 1}")
            if isinstance(peer.hardware, str) and peer.hardware not in HARDWARE:
                raise ValueError(f"peer {peer.name}: unknown hardware {peer.hardware!r}; "
                                 f"known: {', '.join(HARDWARE)}")
            if peer.host is not None and peer.host not in self.host_cores:
                raise ValueError(f"peer {peer.name}: host {peer.host!r} has no cores given")
        if self.shape.layers < stages:
            raise ValueError(f"{self.shape.layers} layers cannot make {stages} stages")
        names = {p.name for p in self.peers}
        for at_s, changed, mbps in self.uplink_changes:
            if at_s < 0 or mbps <= 0 or not set(changed) <= names:
                raise ValueError(f"an uplink change needs a time >= 0, a rate > 0 and known "
                                 f"peers, got {at_s}, {mbps}, {changed}")
        for kill in self.kills:
            if kill.peer not in names or kill.at_s < 0 or (kill.back_after_s or 0) < 0:
                raise ValueError(f"a kill needs a known peer and times >= 0, got {kill}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")
