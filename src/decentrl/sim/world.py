"""The simulated swarm's state, shared by its processes (sim/generation.py, sim/training.py,
sim/checks.py): the clock, the network, the coordinator's endpoint and CPU, the peers of every
stage, the learner's version, and what the run counts (`Tally`)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import simpy

from decentrl.model.stages import StagePlan
from decentrl.sim.costs import Speed, StageCosts
from decentrl.sim.network import Endpoint, Network
from decentrl.sim.peers import Replica, SimPeer, TrainingPeer
from decentrl.sim.scenario import Kill, PeerSpec, Scenario

# A keyframe is the stage's float32 published state (sync/distribute.py).
KEYFRAME_BYTES_PER_PARAMETER = 4


@dataclass
class Group:
    """A finished rollout group: its tokens, the oldest version of each stage that sampled it,
    whether its rewards vary, and who produced it."""

    group_id: int
    rows: int
    prompt_tokens: int
    completion_tokens: list[int]
    stage_versions: list[int]
    has_spread: bool
    producers: frozenset[str]
    finished_at: float

    @property
    def tokens(self) -> int:
        return sum(self.completion_tokens)


@dataclass
class Tally:
    """What the run counts; sim/report.py turns it into the figures."""

    generated_tokens: int = 0
    steps_done: int = 0
    groups: Counter[str] = field(default_factory=Counter)  # produced, trained, dropped: why
    staleness: list[int] = field(default_factory=list)  # per trained group
    # Per step, undone ones included (as the real metrics.jsonl keeps them): end, wait, train;
    # and the completion tokens of its groups.
    step_times: list[tuple[float, float, float]] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    propagation_s: list[float] = field(default_factory=list)  # publish -> last replica applied
    spot_checks: int = 0
    failovers: int = 0
    bans: int = 0
    rejoins: int = 0
    kills: int = 0
    rollbacks: int = 0
    steps_undone: int = 0
    session_step_s: list[float] = field(default_factory=list)  # decoding steps' round trips
    rows_stepped: int = 0  # rows of decoding steps (a session's finished rows included)
    decode_steps: int = 0
    # At each optimizer step, what the rows-in-flight policy reports (the real run's step
    # metrics rows_stepped_per_s and step_round_trip_s: its recent peak rate, its floor).
    policy_rates: list[float] = field(default_factory=list)
    policy_round_trips: list[float] = field(default_factory=list)
    # Seconds of decoding steps by where they went (sim/generation.py `_timed`).
    decode_time: Counter[str] = field(default_factory=Counter)


class World:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.config = scenario.config
        self.env = simpy.Environment()
        self.random = random.Random(scenario.seed)
        self.network = Network(self.env, scenario.links, scenario.seed)
        coordinator = scenario.coordinator
        # A host's cores serve its peers by priority: on one machine the demo's inference
        # replicas are niced below the training chain (launch/local_swarm.py).
        self.hosts = {name: simpy.PriorityResource(self.env, cores)
                      for name, cores in scenario.host_cores.items()}
        self.coordinator: Endpoint = self.network.endpoint(
            "coordinator", coordinator.region, False, coordinator.uplink_mbps,
            coordinator.downlink_mbps)
        self.coordinator_cpu = (self.hosts[coordinator.host] if coordinator.host is not None
                                else simpy.PriorityResource(self.env, coordinator.cpu_cores))
        if coordinator.host is not None:
            self.coordinator.cpu = self.coordinator_cpu
        self.coordinator_cpu_s = 0.0
        self.restart_cpu_s: Counter[str] = Counter()  # per host: restarted processes' start
        self.plan = StagePlan.of(scenario.shape.layers, self.config.num_stages,
                                 self.config.stage_layers)
        self.replicas: list[list[Replica]] = [[] for _ in range(self.config.num_stages)]
        self.trainers: list[list[TrainingPeer]] = [[] for _ in range(self.config.num_stages)]
        for spec in scenario.peers:
            self.add_peer(spec)
        # The coordinator's inbox of finished groups: one batch (coordinator/swarm_backend.py).
        self.inbox = simpy.Store(self.env, capacity=self.config.rollout.prompts_per_step)
        self.version = 0  # the learner's
        self.tally = Tally()
        self.banned: set[str] = set()
        for change in scenario.uplink_changes:
            self.env.process(self._change_uplinks(*change))
        # A training peer back from a kill: the training loop rolls the run back (sim/training.py).
        self.on_trainer_back: Callable[[TrainingPeer], None] = lambda trainer: None
        for kill in scenario.kills:
            self.env.process(self._kill(kill))

    def stage_costs(self, spec: PeerSpec, speed: Speed) -> StageCosts:
        stage = spec.stage
        layers = len(self.plan.layers(stage))
        return StageCosts(spec.profile(), self.scenario.shape, layers, stage == 0,
                          stage == self.config.num_stages - 1,
                          self.config.swarm.activation_codec, speed,
                          self.scenario.sampling_s_per_logit,
                          self.scenario.checkpoint_s_per_byte)

    def add_peer(self, spec: PeerSpec, serving: bool = True, endpoint: Endpoint | None = None
                 ) -> SimPeer:
        """`spec` joins; with `serving` False it is not alive (taking work) until it is set. A
        peer restarted on its machine keeps its `endpoint` (its link and what it carried)."""
        links = self.scenario.links
        endpoint = endpoint or self.network.endpoint(
            spec.name, spec.region, spec.behind_nat, spec.uplink_mbps or links.uplink_mbps,
            spec.downlink_mbps or links.downlink_mbps)
        device = (self.hosts[spec.host] if spec.host is not None
                  else simpy.PriorityResource(self.env, 1))
        if spec.host is not None:
            endpoint.cpu = device
        costs = self.stage_costs(spec, spec.speed)
        peer: SimPeer
        if spec.role == "inference":
            peer = Replica(self.env, spec, endpoint, device, costs, self.config.swarm)
            self.replicas[spec.stage].append(peer)
        else:
            peer = TrainingPeer(self.env, spec, endpoint, device, costs)
            self.trainers[spec.stage].append(peer)
        peer.alive = serving
        if spec.leaves_at_s is not None:
            self.env.process(self._leave_later(peer, spec.leaves_at_s))
        return peer

    def _leave_later(self, peer: SimPeer, at_s: float) -> Generator[Any, Any, None]:
        joined = self.env.now
        yield self.env.timeout(at_s - joined)
        self.remove(peer)
        rejoin = self.scenario.rejoin_after_s
        if rejoin is None or not isinstance(peer, Replica) or peer.name in self.banned:
            return
        yield self.env.timeout(rejoin)
        self.tally.rejoins += 1
        spec = dataclasses.replace(peer.spec, name=f"{peer.spec.name}+{self.tally.rejoins}",
                                   leaves_at_s=None)
        newcomer = self.add_peer(spec, serving=False)
        yield from self.fetch_weights(newcomer)
        newcomer.alive = True
        self.env.process(self._leave_later(newcomer, self.env.now + at_s - joined))

    def _kill(self, kill: Kill) -> Generator[Any, Any, None]:
        """A chaos kill: the peer is out at once (its queued work fails over) and back under its
        own name `back_after_s` later: a replica once it has fetched its stage's weights, a
        training peer from its last checkpoint (`on_trainer_back`)."""
        yield self.env.timeout(kill.at_s)
        victim = next((p for p in self.peers() if p.name == kill.peer and p.alive), None)
        if victim is None:  # left or banned before
            return
        self.remove(victim)
        self.tally.kills += 1
        if kill.back_after_s is None:  # its restart failed: gone for good
            return
        yield from self._restart(victim.spec, kill.back_after_s)
        if isinstance(victim, Replica):
            back = self.add_peer(dataclasses.replace(victim.spec, leaves_at_s=None),
                                 serving=False, endpoint=victim.endpoint)
            yield from self.fetch_weights(back)
            back.alive = True
        else:
            victim.alive = True
            self.on_trainer_back(victim)

    def _restart(self, spec: PeerSpec, seconds: float) -> Generator[Any, Any, None]:
        """A restart's own work (the process's imports, its stage loaded, its join): on a shared
        host, a core for the time it took."""
        if spec.host is None:
            yield self.env.timeout(seconds)
            return
        with self.hosts[spec.host].request(priority=0) as turn:
            yield turn
            yield self.env.timeout(seconds)
        self.restart_cpu_s[spec.host] += seconds

    def peers(self) -> list[SimPeer]:
        return [*(r for stage in self.replicas for r in stage),
                *(t for stage in self.trainers for t in stage)]

    def _change_uplinks(self, at_s: float, peers: tuple[str, ...], mbps: float
                        ) -> Generator[Any, Any, None]:
        yield self.env.timeout(at_s)
        for name in peers:
            self.network.endpoints[name].uplink_bps = mbps * 1e6

    def stage_parameters(self, stage: int) -> int:
        """The parameters `stage` holds (sim/shapes.py), its layers as the run's plan cuts them."""
        return self.scenario.shape.stage_parameters(
            len(self.plan.layers(stage)), stage == 0, stage == self.config.num_stages - 1)

    def fetch_weights(self, peer: SimPeer) -> Generator[Any, Any, None]:
        """A joining replica's first sync (sync/distribute.py): the stage's latest keyframe, its
        float32 state, in `sync.chunks_per_update` chunks from the training peer or, with
        `sync.peer_exchange`, from the stage's live replicas, which hold it."""
        stage = peer.stage
        trainer = self.trainer(stage)
        if trainer is None:
            return
        chunks = self.config.sync.chunks_per_update
        chunk_bytes = -(-KEYFRAME_BYTES_PER_PARAMETER * self.stage_parameters(stage) // chunks)
        holders: list[list[SimPeer]] = [[trainer, *self.live_replicas(stage)]
                                        for _ in range(chunks)]
        yield from self.fetch_chunks(peer, holders, chunk_bytes)
        peer.version = trainer.version

    def fetch_chunks(self, peer: SimPeer, holders: list[list[SimPeer]], chunk_bytes: int
                     ) -> Generator[Any, Any, None]:
        """`peer`'s fetch of every chunk, `sync.parallel_fetches` at a time, starting at a chunk
        of its own (so that replicas hold different chunks early and can trade them); each chunk
        from a live holder (the first only, without `sync.peer_exchange`), which `peer` then is
        too."""
        sync = self.config.sync
        offset = self.random.randrange(len(holders))
        order = [(offset + i) % len(holders) for i in range(len(holders))]
        lanes = [order[lane::sync.parallel_fetches] for lane in range(sync.parallel_fetches)]
        yield self.env.all_of([self.env.process(self._fetch_lane(peer, holders, lane,
                                                                 chunk_bytes))
                               for lane in lanes if lane])

    def _fetch_lane(self, peer: SimPeer, holders: list[list[SimPeer]], chunks: list[int],
                    chunk_bytes: int) -> Generator[Any, Any, None]:
        for chunk in chunks:
            sources = [p for p in holders[chunk] if p.alive]
            if not self.config.sync.peer_exchange:
                sources = sources[:1]
            if not sources or not peer.alive:
                return
            source = self.random.choice(sources)
            yield from self.network.send(source.endpoint, peer.endpoint, chunk_bytes)
            holders[chunk].append(peer)

    def remove(self, peer: SimPeer) -> None:
        """The peer leaves (churn) or is banned: its queued work fails over."""
        if isinstance(peer, Replica):
            peer.leave()
        else:
            peer.alive = False

    def ban(self, name: str) -> None:
        """A spot check failed the peer: it is out, as the reputation's ban puts it out."""
        self.banned.add(name)
        self.tally.bans += 1
        for peer in self.peers():
            if peer.name == name:
                self.remove(peer)

    def live_replicas(self, stage: int) -> list[Replica]:
        return [r for r in self.replicas[stage] if r.alive]

    def trainer(self, stage: int) -> TrainingPeer | None:
        live = [t for t in self.trainers[stage] if t.alive]
        return live[0] if live else None

    def coordinator_work(self, messages: int, nbytes: int) -> Generator[Any, Any, None]:
        """The coordinator's CPU for relaying or ingesting: checks, sketches, signatures."""
        spec = self.scenario.coordinator
        seconds = messages * spec.seconds_per_message + nbytes * spec.seconds_per_byte
        with self.coordinator_cpu.request(priority=0) as turn:
            yield turn
            yield self.env.timeout(seconds)
        self.coordinator_cpu_s += seconds
