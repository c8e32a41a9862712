"""Scenarios the simulator is checked and projected on (bench/simulate.py runs them).

- `loopback_demo`: `decentrl demo` on this machine: examples/demo.toml, SmolLM2-135M in 2 stages,
  a training peer and two replicas per stage and the coordinator as processes sharing the host's
  cores, every pair of nodes on an emulated link of 60-120 ms round trip (net/link.py draws one per
  pair) with 10 ms of jitter and no bandwidth limit.
- `netns_demo`: `decentrl demo --netns`: the same with four peers behind two home NATs.
- `chaos_demo`: `decentrl demo --chaos`: the loopback demo with peers killed and restarted.
- `operator_swarm`: the multi-host guide's commands, walked in network namespaces (4 or 6
  stages of a tiny model, tests/netns/test_operator_netns.py).
- `internet_swarm`: a model on `peers` consumer machines drawn from sim/hardware.py's table,
  spread over five regions with the round trips between them, a share behind NAT, sessions of a
  given mean length (churn) and a share of adversaries; one training peer per stage (the
  machines with the most memory that hold a training stage), every other peer a replica."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from decentrl.config import RunConfig
from decentrl.demo import (
    NETNS_HOMES,
    NETNS_THROTTLE_MBIT,
    NETNS_THROTTLED_HOME,
    NETNS_UPLINK_MBIT,
)
from decentrl.sim.costs import CHECKPOINT_S_PER_BYTE, SAMPLING_S_PER_LOGIT, Speed
from decentrl.sim.hardware import HardwareProfile
from decentrl.sim.machines import HARDWARE
from decentrl.sim.scenario import (
    CoordinatorSpec,
    DataPlane,
    Kill,
    LinkSpec,
    PeerSpec,
    Scenario,
    Workload,
)
from decentrl.sim.shapes import SMOLLM2_135M, ModelShape

# The loopback demo's links (examples/demo.toml [host] link).
DEMO_RTT_MS = (60.0, 120.0)
DEMO_JITTER_MS = 10.0
LOOPBACK_MBPS = 10_000.0
# Its workload: chat prompts of one sum (SmolLM2's template: about 40 tokens) and answers of
# 16-17 of the 20 tokens allowed (the demo logs' mean completion length).
DEMO_WORKLOAD = Workload(prompt_tokens=40, completion_share=(0.65, 1.0), spread_share=0.7)

# Round trips between regions (ms), medians of public ping tables between major cities
# (WonderNetwork's global ping statistics, https://wondernetwork.com/pings): within a
# region 30; North America - Europe 90, - Asia 160, - South America 150, - Oceania 180;
# Europe - Asia 200 (estimated from Frankfurt - Tokyo / Singapore), - South America 200,
# - Oceania 280; Asia - South America 300, - Oceania 120; South America - Oceania 300.
REGIONS = ("na", "eu", "asia", "sa", "oce")
REGION_SHARE = (0.35, 0.30, 0.20, 0.10, 0.05)
_BETWEEN = {("na", "eu"): 90, ("na", "asia"): 160, ("na", "sa"): 150, ("na", "oce"): 180,
            ("eu", "asia"): 200, ("eu", "sa"): 200, ("eu", "oce"): 280, ("asia", "sa"): 300,
            ("asia", "oce"): 120, ("sa", "oce"): 300}
# Home access links (Mbit/s up, down) and their shares: cable or DSL, a mid-range plan, fiber
# (estimated from Ookla's Speedtest Global Index medians of fixed broadband, 2024-2025: download
# ~100-250 Mbit/s in the large markets, upload far lower outside fiber).
ACCESS_LINKS = ((10.0, 100.0), (40.0, 300.0), (300.0, 500.0))
ACCESS_SHARE = (0.3, 0.4, 0.3)
# A training peer's link: the operator admits them (admitted.txt), and picks fiber.
TRAINING_LINK = ACCESS_LINKS[-1]
# The positions of a training micro-batch a training peer must hold activations for.
TRAIN_TOKENS = 8 * 1280
INTERNET_RTT_MS = {**{(r, r): 30.0 for r in REGIONS},
                   **{pair: float(ms) for pair, ms in _BETWEEN.items()}}


@dataclass(frozen=True)
class HostCalibration:
    """This host as the runs measured on it are simulated (sim/calibration.py `calibrate`
    measures every field): its single-core profile and cores, the fitted speed of each kind of
    work, the coordinator's CPU per relayed message and byte, a request and its reply's
    software time beyond their link (seconds, and seconds per byte they carry), a seeded draw's
    CPU per logit, and a checkpoint's seconds per byte."""

    profile: HardwareProfile
    cores: int
    speed: Speed = Speed()
    relay_costs: tuple[float, float] = (2e-4, 2e-9)
    hop_overhead: tuple[float, float] = (0.0, 0.0)
    sampling_s_per_logit: float = SAMPLING_S_PER_LOGIT
    checkpoint_s_per_byte: float = CHECKPOINT_S_PER_BYTE


def loopback_demo(config: RunConfig, host: HostCalibration, duration_s: float | None = None,
                  seed: int = 0, data_plane: DataPlane = "coordinator") -> Scenario:
    """The demo of `config` (examples/demo.toml) on `host`, each peer computing on one of its
    cores with its single-core profile times the fitted speeds."""
    stages = config.num_stages
    replicas = config.swarm.inference_replicas
    peers = []
    for stage in range(stages):
        peers.append(PeerSpec(f"train{stage}", stage, "training", host.profile,
                              f"train{stage}", host="this", speed=host.speed))
        peers += [PeerSpec(f"infer{stage}.{index}", stage, "inference", host.profile,
                           f"infer{stage}.{index}", host="this", speed=host.speed)
                  for index in range(replicas)]
    draw = random.Random(seed)
    regions = ["coordinator", *(p.region for p in peers)]
    low, high = DEMO_RTT_MS
    rtt = {(a, b): (0.0 if a == b else draw.uniform(low, high))
           for a, b in itertools.combinations_with_replacement(regions, 2)}
    links = LinkSpec(rtt, uplink_mbps=LOOPBACK_MBPS, downlink_mbps=LOOPBACK_MBPS,
                     jitter_ms=DEMO_JITTER_MS, **_software(host))
    return Scenario(config, SMOLLM2_135M, tuple(peers), _coordinator(host, "coordinator"),
                    links, DEMO_WORKLOAD, data_plane,
                    duration_s or config.train.time_budget_s or 720.0, seed, {"this": host.cores},
                    sampling_s_per_logit=host.sampling_s_per_logit,
                    checkpoint_s_per_byte=host.checkpoint_s_per_byte)


def _software(host: HostCalibration) -> dict[str, float]:
    """A message's software time on `host` (half of a request and its reply's fixed part)."""
    fixed, per_byte = host.hop_overhead
    return {"message_overhead_ms": fixed * 500.0, "message_overhead_s_per_byte": per_byte}


def _coordinator(host: HostCalibration, region: str) -> CoordinatorSpec:
    """The coordinator as a process of `host`, on its cores, on loopback."""
    return CoordinatorSpec(region, LOOPBACK_MBPS, LOOPBACK_MBPS, host.cores,
                           seconds_per_message=host.relay_costs[0],
                           seconds_per_byte=host.relay_costs[1], host="this")


def netns_demo(config: RunConfig, host: HostCalibration, seed: int = 0,
               data_plane: DataPlane = "coordinator") -> Scenario:
    """`decentrl demo --netns` (demo.py NETNS_HOMES): the loopback demo with four of the six
    peers behind two home NATs on 50 Mbit/s uplinks, home2's dropping to 0.5 Mbit/s halfway
    through the training budget. (Each home peer has its own uplink here; the real two share
    their router's.)"""
    loopback = loopback_demo(config, host, seed=seed, data_plane=data_plane)
    homes = {peer: home for home, peers in NETNS_HOMES for peer in peers}
    peers = tuple(dataclasses.replace(p, behind_nat=True, uplink_mbps=NETNS_UPLINK_MBIT)
                  if p.name in homes else p for p in loopback.peers)
    throttled_home = NETNS_HOMES[NETNS_THROTTLED_HOME - 1][0]
    throttled = tuple(peer for peer, home in homes.items() if home == throttled_home)
    halfway = loopback.duration_s / 2
    return dataclasses.replace(loopback, peers=peers,
                               uplink_changes=((halfway, throttled, NETNS_THROTTLE_MBIT),))


def chaos_demo(config: RunConfig, host: HostCalibration, kills: tuple[Kill, ...],
               seed: int = 0, data_plane: DataPlane = "coordinator") -> Scenario:
    """`decentrl demo --chaos`: the loopback demo with `kills` (a measured run's, read by
    sim/calibration.py `measured_run`, so the simulation meets the same peers killed at the same
    times)."""
    return dataclasses.replace(loopback_demo(config, host, seed=seed, data_plane=data_plane),
                               kills=kills)


# The operator walk's homes (tests/netns/test_operator_netns.py): veth pairs without emulation,
# round trips of about 0.1 ms, home uplinks shaped to 50 Mbit/s (net/netns.py).
OPERATOR_RTT_MS = 0.1
OPERATOR_UPLINK_MBIT = 50.0


def operator_swarm(config: RunConfig, shape: ModelShape, host: HostCalibration, seed: int = 0,
                   data_plane: DataPlane = "coordinator") -> Scenario:
    """The multi-host guide walked by an operator (tests/netns/test_operator_netns.py): every
    stage's training peer (home 1 for even stages, home 2 for odd ones) and one replica (the
    other home), each a process of its own behind its home's NAT on a 50 Mbit/s uplink, the
    coordinator and the relay on the public segment; every process on `host`'s cores. The run
    ends after `config.train.steps`."""
    stages = config.num_stages
    peers = []
    for stage in range(stages):
        for role, name in (("training", f"train{stage}"), ("inference", f"infer{stage}")):
            peers.append(PeerSpec(name, stage, role, host.profile, "lan", True, host="this",
                                  speed=host.speed, uplink_mbps=OPERATOR_UPLINK_MBIT))
    links = LinkSpec({("lan", "lan"): OPERATOR_RTT_MS}, uplink_mbps=LOOPBACK_MBPS,
                     downlink_mbps=LOOPBACK_MBPS, relay_extra_rtt_ms=OPERATOR_RTT_MS,
                     **_software(host))
    # A random model rarely ends its answer before max_new_tokens.
    workload = dataclasses.replace(DEMO_WORKLOAD, completion_share=(1.0, 1.0))
    return Scenario(config, shape, tuple(peers), _coordinator(host, "lan"), links, workload,
                    data_plane, config.train.time_budget_s or 600.0, seed, {"this": host.cores},
                    sampling_s_per_logit=host.sampling_s_per_logit,
                    checkpoint_s_per_byte=host.checkpoint_s_per_byte)


def internet_swarm(config: RunConfig, shape: ModelShape, peers: int, *,
                   behind_nat: float = 0.3, mean_session_s: float | None = 7200.0,
                   adversaries: float = 0.0, duration_s: float = 1800.0, seed: int = 0,
                   data_plane: DataPlane = "coordinator", workload: Workload = Workload(),
                   hardware: Sequence[str] | None = None, coordinator_mbps: float = 1000.0,
                   rejoin_after_s: float | None = 300.0) -> Scenario:
    """`peers` machines drawn (seeded) from `hardware` (default: every GPU and Mac of the
    table), the first of each stage's draw that holds a training stage training it, on a fiber
    link (TRAINING_LINK). A peer
    leaves after an exponential session of mean `mean_session_s` (None: nobody leaves); a share
    `adversaries` of the replicas lie; one that leaves is replaced `rejoin_after_s` later. Each
    peer's access link is drawn from ACCESS_LINKS; the
    coordinator has `coordinator_mbps` both ways (a server's link)."""
    stages = config.num_stages
    names = list(hardware or [name for name, p in HARDWARE.items() if p.kind != "cpu"])
    draw = random.Random(seed)
    machines = [draw.choice(names) for _ in range(peers)]
    layers = -(-shape.layers // stages)
    # Each stage's training peer: the stages that need most memory first (the head's, the
    # embedding's), each on the smallest drawn machine that holds it, so the largest cards are
    # left for the stages that need them.
    def need(stage: int, name: str) -> float:
        return HARDWARE[name].memory_needed_gib(shape, layers, "training", stage == 0,
                                                stage == stages - 1, train_tokens=TRAIN_TOKENS)

    roles: dict[int, tuple[int, str]] = {}
    by_memory = sorted(range(peers), key=lambda i: HARDWARE[machines[i]].usable_gib)
    for stage in sorted(range(stages), key=lambda s: -need(s, names[0])):
        fitting = next((i for i in by_memory if i not in roles
                        and need(stage, machines[i]) <= HARDWARE[machines[i]].usable_gib), None)
        if fitting is None:
            raise ValueError(f"no drawn machine holds stage {stage}'s training state ({layers} "
                             f"layers of {shape.name}): use more stages or larger machines")
        roles[fitting] = (stage, "training")
    replicas = [i for i in range(peers) if i not in roles]
    for position, index in enumerate(replicas):
        roles[index] = (position % stages, "inference")
    specs: list[PeerSpec] = []
    for index in range(peers):
        stage, role = roles[index]
        leaves = (draw.expovariate(1.0 / mean_session_s)
                  if mean_session_s is not None and role == "inference" else None)
        up, down = draw.choices(ACCESS_LINKS, ACCESS_SHARE)[0]
        if role == "training":  # the operator admits training peers: well-connected ones
            up, down = TRAINING_LINK
        specs.append(PeerSpec(
            f"peer{index}", stage, role, machines[index], draw.choices(REGIONS, REGION_SHARE)[0],
            draw.random() < behind_nat,
            leaves_at_s=leaves if leaves is not None and leaves < duration_s else None,
            adversary=role == "inference" and draw.random() < adversaries, uplink_mbps=up,
            downlink_mbps=down))
    links = LinkSpec(INTERNET_RTT_MS, jitter_ms=5.0)
    coordinator = CoordinatorSpec("na", coordinator_mbps, coordinator_mbps)
    return Scenario(config, shape, tuple(specs), coordinator, links, workload, data_plane,
                    duration_s, seed, rejoin_after_s=rejoin_after_s)
