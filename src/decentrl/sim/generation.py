"""Simulated generation: the coordinator's sessions (coordinator/generation.py), as many at once
as the real policy says: coordinator/inflight.py `RowsInFlight`, driven by the simulated clock
and fed every decoding step's round trip, exactly as the real sessions feed it. A session holds
`groups_per_session` groups of `group_size` rows; it prefills the prompts, then decodes one
position per step through one replica per stage until its longest row is done.

A step's path is the data plane's (scenario.py `DataPlane`): through the coordinator, which sends
each stage its input and checks and sketches each reply (client/sessions.py), or from one
stage's replica to the next, the coordinator sending token ids to stage 0 and getting the
tokens and the sketches back. A replica that leaves mid-session is replaced, and the new one
recomputes the session from position 0 (client/sessions.py's failover)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from decentrl.coordinator.inflight import RowsInFlight
from decentrl.sim.peers import PeerGone, Replica
from decentrl.sim.world import Group, World

# How often the launcher looks at the policy's session limit, and how long a session waits for a
# stage that has no live replica.
LAUNCH_POLL_S = 0.5
NO_REPLICA_WAIT_S = 1.0
# A stage's sketch of one position (32 floats, trust/commit.py) that the peer-to-peer data plane
# sends the coordinator beside the activations it forwards.
SKETCH_BYTES = 32 * 4


class Generation:
    def __init__(self, world: World) -> None:
        self.world = world
        config = world.config
        self.stages = config.num_stages
        self.inflight = RowsInFlight(
            config, lambda: [len(world.live_replicas(s)) for s in range(self.stages)],
            clock=lambda: world.env.now)
        self.running = 0
        self.next_group = 0
        world.env.process(self._launch())

    def _launch(self) -> Generator[Any, Any, None]:
        env = self.world.env
        while True:
            while self.running < self.inflight.slots.limit:
                self.running += 1
                env.process(self._session())
            yield env.timeout(LAUNCH_POLL_S)

    def _pick(self, stage: int, avoid: frozenset[str] = frozenset()
              ) -> Generator[Any, Any, Replica]:
        """The live replica of `stage` with the fewest sessions, the nearest among equals."""
        world = self.world
        while True:
            live = [r for r in world.live_replicas(stage) if r.name not in avoid] \
                or world.live_replicas(stage)
            if live:
                return min(live, key=lambda r: (r.sessions, world.network.round_trip_s(
                    world.coordinator, r.endpoint)))
            yield world.env.timeout(NO_REPLICA_WAIT_S)

    def _session(self) -> Generator[Any, Any, None]:
        world = self.world
        config, workload = world.config, world.scenario.workload
        rows = self.inflight.session_rows
        low, high = workload.completion_share
        lengths = [max(1, round(world.random.uniform(low, high)
                                * config.rollout.max_new_tokens)) for _ in range(rows)]
        chain: list[Replica] = []
        for stage in range(self.stages):
            chain.append((yield from self._pick(stage)))
            chain[-1].sessions += 1
        producers = {r.name for r in chain}
        versions = [r.version for r in chain]
        context = 0
        try:
            for step in range(max(lengths)):
                positions = workload.prompt_tokens if step == 0 else 1
                started = world.env.now
                yield from self._step(chain, rows, positions, context, producers)
                context += positions
                versions = [min(v, r.version) for v, r in zip(versions, chain)]
                world.tally.generated_tokens += sum(1 for length in lengths if length > step)
                if positions == 1:
                    seconds = world.env.now - started
                    world.tally.decode_steps += 1
                    self.inflight.observe(rows, 1, workload.prompt_tokens + max(lengths),
                                          seconds)
                    world.tally.session_step_s.append(seconds)
                    world.tally.rows_stepped += rows
        finally:
            for replica in chain:
                replica.sessions -= 1
        # The loop that ran the session puts its groups into the coordinator's inbox, waiting
        # while it is full (coordinator/generation.py), before it starts another.
        size = config.rollout.group_size
        for first in range(0, rows, size):
            self.next_group += 1
            world.tally.groups["produced"] += 1
            yield world.inbox.put(Group(
                self.next_group, size, workload.prompt_tokens, lengths[first:first + size],
                list(versions), world.random.random() < workload.spread_share,
                frozenset(producers), world.env.now))
        self.running -= 1

    def _step(self, chain: list[Replica], rows: int, positions: int, context: int,
              producers: set[str]) -> Generator[Any, Any, None]:
        """One step through every stage; a replica that is gone is replaced and the session
        replayed there from position 0."""
        world = self.world
        peer_to_peer = world.scenario.data_plane == "peer_to_peer"
        for stage in range(self.stages):
            new, cached = positions, context
            failed_at: float | None = None
            while True:
                replica = chain[stage]
                try:
                    if peer_to_peer and stage > 0:  # the previous stage's activations
                        nbytes = chain[stage - 1].costs.output_bytes(rows * new)
                        yield from self._timed(new, "network", world.network.send(
                            chain[stage - 1].endpoint, replica.endpoint, nbytes))
                    yield from self._hop(stage, replica, rows, new, cached)
                    break
                except PeerGone:
                    # A decoding step's failover (a replica found, the session replayed there)
                    # is its own part of the step's time.
                    if failed_at is None and positions == 1:
                        failed_at = world.env.now
                    world.tally.failovers += 1
                    replica.sessions -= 1
                    chain[stage] = yield from self._pick(stage, frozenset({replica.name}))
                    chain[stage].sessions += 1
                    producers.add(chain[stage].name)
                    # The newcomer recomputes the session so far, then this step.
                    new, cached = positions + context, 0
            if failed_at is not None:
                world.tally.decode_time["failover"] += world.env.now - failed_at

    def _hop(self, stage: int, replica: Replica, rows: int, positions: int, context: int
             ) -> Generator[Any, Any, None]:
        """Stage `stage`'s part of a step: its input arrives (from the coordinator, or already
        from the previous stage), it computes, its output leaves for the coordinator (or, peer
        to peer, the next stage takes it, and the coordinator gets a sketch)."""
        world = self.world
        network, coordinator = world.network, world.coordinator
        costs = replica.costs
        last = stage == self.stages - 1
        peer_to_peer = world.scenario.data_plane == "peer_to_peer"
        if stage == 0 or not peer_to_peer:
            yield from self._timed(positions, "network", network.send(
                coordinator, replica.endpoint, costs.input_bytes(rows * positions)))
        yield from self._timed(positions, "replica", self._await(
            replica.step(rows, positions, context)))
        if last or not peer_to_peer:
            out_bytes = costs.output_bytes(rows if last else rows * positions)
            yield from self._timed(positions, "network", network.send(
                replica.endpoint, coordinator, out_bytes))
            yield from self._timed(positions, "coordinator",
                                   world.coordinator_work(1, out_bytes))
            return
        world.env.process(self._report_sketch(replica, rows * positions * SKETCH_BYTES))

    def _timed(self, positions: int, part: str, work: Generator[Any, Any, None]
               ) -> Generator[Any, Any, None]:
        """`work`, its seconds added to a decoding step's `part` (network: sending and waiting
        for links; replica: queueing and computing; coordinator: its CPU; failover, counted
        apart: finding another replica and replaying the session there)."""
        began = self.world.env.now
        yield from work
        if positions == 1:
            self.world.tally.decode_time[part] += self.world.env.now - began

    @staticmethod
    def _await(event: simpy.Event) -> Generator[Any, Any, None]:
        yield event

    def _report_sketch(self, replica: Replica, nbytes: int) -> Generator[Any, Any, None]:
        world = self.world
        yield from world.network.send(replica.endpoint, world.coordinator, nbytes)
        yield from world.coordinator_work(1, nbytes)
