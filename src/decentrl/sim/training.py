"""Simulated training and weight sync. Finished groups wait in the coordinator's inbox (one
batch of them: net/swarm_transport.py; a full inbox holds generation back) and its pool
(coordinator/pool.py); a step collects its groups as the real pool does, dropping those past
the staleness bound with the real check (learn/losses.py `check_staleness`). Its micro-batches
go forward through every stage's training peer and backward in reverse, one after another
(learn/trainer.py `PipelineTrainer.train_step`), their activations and gradients through the
coordinator or from peer to peer; then every stage steps its optimizer, the version moves on, and each training peer
publishes its update (sync/distribute.py): a sparse int8 delta of `sync.density` of its
parameters, a dense keyframe every `sync.keyframe_every` versions. Replicas fetch it from the
publisher or, with `sync.peer_exchange`, from a replica that has it already. A training peer
back from a kill rolls the run back to the last checkpoint (`roll_back`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

from decentrl.config import SyncConfig
from decentrl.coordinator.pool import DYNAMIC_SAMPLING_LIMIT
from decentrl.learn.losses import StaleRolloutError, check_staleness
from decentrl.sim.peers import PeerGone, Replica, SimPeer, TrainingPeer
from decentrl.sim.world import KEYFRAME_BYTES_PER_PARAMETER, Group, World

# An update entry on the wire (sync/delta.py): its int32 index and its value (int8 with a
# float32 scale per QUANT_BLOCK = 256 values, or a bf16 value).
INDEX_BYTES = 4
VALUE_BYTES = {"int8_delta": 1 + 4 / 256, "bf16_value": 2}
# How often the training loop looks at the pool when it cannot fill a batch.
POOL_POLL_S = 0.2


def update_bytes(parameters: int, version: int, sync: SyncConfig) -> int:
    """The bytes a stage of `parameters` publishes for `version`."""
    if sync.mode == "dense" or version % sync.keyframe_every == 0:
        return parameters * KEYFRAME_BYTES_PER_PARAMETER
    return math.ceil(parameters * sync.density * (INDEX_BYTES + VALUE_BYTES[sync.values]))


class Training:
    def __init__(self, world: World,
                 on_step: Callable[[list[tuple[int, int]]], None] = lambda micro: None
                 ) -> None:
        """`on_step`: called after each step with its micro-batches' (tokens, rows): the
        audits. `accept` (set by the wiring, sim/run.py) takes a group out of the inbox: it
        joins `pool` at once, or after its spot check."""
        self.world, self.on_step = world, on_step
        self.accept: Callable[[Group], None] = self.add
        self.after_step: Callable[[], None] = lambda: None  # what a real step records beside
        self.pool: list[Group] = []
        self.in_step = 0  # groups of the step under way
        self.collecting: list[tuple[Group, int]] = []  # the next step's, gathered so far
        # The groups of each step since the last checkpoint (a rollback returns them).
        self.since_checkpoint: list[list[tuple[Group, int]]] = []
        world.on_trainer_back = self.roll_back
        self.finished = world.env.event()  # the run's `train.steps` are done
        world.env.process(self._loop())

    def add(self, group: Group) -> None:
        """A group accepted (its spot check, if any, passed): it waits for a step."""
        self.pool.append(group)

    def _collect(self) -> Generator[Any, Any, list[tuple[Group, int]]]:
        """One step's groups with their staleness, as coordinator/pool.py `GroupPool.collect`
        gathers them: pending groups first (re-checked: banned producers and stale ones are
        dropped), then arrivals from the inbox (accepted, maybe held for a check). Under
        dynamic sampling only groups with reward spread count, and the others come along up to
        DYNAMIC_SAMPLING_LIMIT times the batch."""
        world = self.world
        train = world.config.train
        needed = world.config.rollout.prompts_per_step
        limit = needed * DYNAMIC_SAMPLING_LIMIT if train.dynamic_sampling else needed
        batch = self.collecting  # a rollback may take its groups back meanwhile

        def teaching() -> int:
            return sum(g.has_spread or not train.dynamic_sampling for g, _ in batch)

        while teaching() < needed and len(batch) < limit:
            if self.pool:
                group = self.pool.pop(0)
                if group.producers & world.banned:
                    world.tally.groups["dropped: producer banned"] += 1
                    continue
                if max(group.stage_versions) > world.version:
                    world.tally.groups["dropped: sampled by a rolled-back version"] += 1
                    continue
                try:
                    staleness = check_staleness(world.version, group.stage_versions,
                                                train.max_staleness)
                except StaleRolloutError:
                    world.tally.groups["dropped: stale"] += 1
                    continue
                batch.append((group, staleness))
                continue
            arrival = world.inbox.get()
            yield arrival | world.env.timeout(POOL_POLL_S)
            if arrival.triggered:
                self.accept(arrival.value)
            else:
                arrival.cancel()
        collected = list(batch)
        batch.clear()
        return collected

    def _loop(self) -> Generator[Any, Any, None]:
        world = self.world
        env = world.env
        while True:
            waited_from = env.now
            collected = yield from self._collect()
            self.in_step = len(collected)
            # Groups without reward spread carry no gradient: dropped from the batch
            # (learn/advantages.py filter_zero_variance_groups), counted as trained.
            batch = [g for g, _ in collected
                     if g.has_spread or world.config.train.zero_variance_groups != "drop"]
            began = env.now
            try:
                yield from self._step(batch)
            except PeerGone:  # a training peer left: the step failed, its groups wait again
                self.pool[:0] = [group for group, _ in collected]
                yield env.timeout(POOL_POLL_S)
                continue
            finally:
                self.in_step = 0
            world.version += 1
            world.tally.steps_done += 1
            world.tally.groups["trained"] += len(collected)
            world.tally.staleness += [staleness for _, staleness in collected]
            world.tally.step_times.append((env.now, began - waited_from, env.now - began))
            world.tally.step_tokens.append(sum(group.tokens for group, _ in collected))
            self.since_checkpoint.append(collected)
            if world.version % world.config.train.checkpoint_every == 0:
                # Every stage saves before the next step (coordinator/loop.py `checkpoint`).
                yield from self._checkpoint()
            self.after_step()
            if world.tally.steps_done >= world.config.train.steps:
                self.finished.succeed()
                return
            for stage in range(world.config.num_stages):
                env.process(self._publish(stage, world.version))

    def _checkpoint(self) -> Generator[Any, Any, None]:
        """Each stage's training peer saves its state. A save that fails (the peer is gone)
        costs the run this checkpoint only, as a periodic save's failure does."""
        world = self.world
        trainers = [world.trainer(stage) for stage in range(world.config.num_stages)]
        saved = yield world.env.all_of([world.env.process(self._save(t))
                                        for t in trainers if t is not None])
        if None not in trainers and all(saved.values()):
            self.since_checkpoint = []

    @staticmethod
    def _save(trainer: TrainingPeer) -> Generator[Any, Any, bool]:
        try:
            yield from trainer.checkpoint()
        except PeerGone:
            return False
        return True

    def roll_back(self, trainer: TrainingPeer) -> None:
        """A training peer restarted from its last checkpoint, behind the others: the run goes
        back to that checkpoint (coordinator/loop.py `reconcile`). The steps after it are undone
        and their groups pending again; groups sampled by an undone version are dropped; every
        training peer is at the checkpoint and every replica re-syncs to it by a keyframe."""
        world, tally = self.world, self.world.tally
        checkpoint = world.version - len(self.since_checkpoint)
        trainer.version = checkpoint
        if checkpoint == world.version:  # it died at a checkpoint: every stage agrees
            return
        undone = self.since_checkpoint
        self.since_checkpoint = []
        returned = [group for collected in undone for group, _ in collected]
        if returned:
            tally.groups["trained"] -= len(returned)
            del tally.staleness[-len(returned):]
        tally.rollbacks += 1
        tally.steps_undone += len(undone)
        tally.steps_done -= len(undone)
        world.version = checkpoint
        kept = []
        gathered = [group for group, _ in self.collecting]
        self.collecting.clear()
        for group in returned + gathered + self.pool:
            if max(group.stage_versions) > checkpoint:
                tally.groups["dropped: sampled by a rolled-back version"] += 1
            else:
                kept.append(group)
        self.pool = kept
        for stage in range(world.config.num_stages):
            for peer in world.trainers[stage]:
                peer.version = min(peer.version, checkpoint)
            for replica in world.replicas[stage]:
                replica.version = min(replica.version, checkpoint)
            world.env.process(self._publish(stage, checkpoint, keyframe=True))

    def _step(self, batch: list[Group]) -> Generator[Any, Any, None]:
        world = self.world
        stages = world.config.num_stages
        trainers: list[TrainingPeer] = []
        for stage in range(stages):
            trainer = world.trainer(stage)
            if trainer is None:
                raise PeerGone(f"stage {stage} has no training peer")
            trainers.append(trainer)
        rows = [(g.prompt_tokens + length) for g in batch for length in g.completion_tokens]
        micro = world.config.train.micro_batch_size
        micro_batches = [(sum(rows[start:start + micro]), len(rows[start:start + micro]))
                         for start in range(0, len(rows), micro)]
        for tokens, micro_rows in micro_batches:
            for stage, trainer in enumerate(trainers):
                yield from self._carry(trainers, stage, tokens, forward=True)
                yield from trainer.forward(tokens, micro_rows)
            for stage in reversed(range(stages)):
                yield from self._carry(trainers, stage, tokens, forward=False)
                yield from trainers[stage].backward(tokens, micro_rows)
        steps = [world.env.process(t.optimizer_step()) for t in trainers]
        yield world.env.all_of(steps)
        for trainer in trainers:
            trainer.version = world.version + 1
        self.on_step(micro_batches)

    def _carry(self, trainers: list[TrainingPeer], stage: int, tokens: int, forward: bool
               ) -> Generator[Any, Any, None]:
        """What stage `stage` needs before its forward (its input: the batch at stage 0, the
        previous stage's outputs after) or its backward (the next stage's gradients; the last
        stage computes its loss itself), through the coordinator or from the neighbour."""
        world = self.world
        last = len(trainers) - 1
        costs = trainers[stage].costs
        if forward and stage == 0:
            yield from world.network.send(world.coordinator, trainers[0].endpoint,
                                          costs.input_bytes(tokens))
            return
        if not forward and stage == last:
            return
        neighbour = trainers[stage - 1] if forward else trainers[stage + 1]
        nbytes = neighbour.costs.output_bytes(tokens) if forward else costs.output_bytes(tokens)
        if world.scenario.data_plane == "peer_to_peer":
            yield from world.network.send(neighbour.endpoint, trainers[stage].endpoint, nbytes)
            return
        yield from world.network.send(neighbour.endpoint, world.coordinator, nbytes)
        yield from world.coordinator_work(1, nbytes)
        yield from world.network.send(world.coordinator, trainers[stage].endpoint, nbytes)

    def _publish(self, stage: int, version: int, keyframe: bool = False
                 ) -> Generator[Any, Any, None]:
        """The stage's update (its whole state with `keyframe`) reaches every live replica, in
        `sync.chunks_per_update` chunks, `sync.parallel_fetches` at a time; each replica applies
        it once it has every chunk."""
        world = self.world
        publisher = world.trainer(stage)
        if publisher is None:
            return
        sync = world.config.sync
        chunks = sync.chunks_per_update
        parameters = world.stage_parameters(stage)
        size = (parameters * KEYFRAME_BYTES_PER_PARAMETER if keyframe
                else update_bytes(parameters, version, sync))
        chunk_bytes = math.ceil(size / chunks)
        began = world.env.now
        holders: list[list[SimPeer]] = [[publisher] for _ in range(chunks)]
        fetches = [world.env.process(self._fetch(replica, holders, chunk_bytes, version,
                                                 keyframe))
                   for replica in world.live_replicas(stage)]
        yield world.env.all_of(fetches)
        if fetches:
            world.tally.propagation_s.append(world.env.now - began)

    def _fetch(self, replica: Replica, holders: list[list[SimPeer]], chunk_bytes: int,
               version: int, keyframe: bool) -> Generator[Any, Any, None]:
        """One replica's fetch of the update (World.fetch_chunks). An update a rollback undid
        while it travelled is not applied; a rollback's keyframe replaces."""
        world = self.world
        yield from world.fetch_chunks(replica, holders, chunk_bytes)
        if replica.alive and version <= world.version:
            replica.version = version if keyframe else max(replica.version, version)
