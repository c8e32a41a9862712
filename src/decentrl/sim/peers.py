"""Simulated peers: an inference replica batches the steps of every session it serves into one
forward (stage/batching.py: it waits `swarm.batch_wait_s` for more, up to `swarm.batch_max_rows`
rows), a training peer runs a stage's forward, backward and optimizer step. Each computes on its
device, a queue of one; peers of one host (the loopback demo) share its cores instead. Every
second of compute is booked under what it was for, so the run reports the spot checks' share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from decentrl.config import SwarmConfig
from decentrl.sim.costs import StageCosts
from decentrl.sim.network import Endpoint
from decentrl.sim.scenario import PeerSpec


class PeerGone(Exception):
    """The peer left (churn) or was banned while a request waited on it."""


class SimPeer:
    def __init__(self, env: simpy.Environment, spec: PeerSpec, endpoint: Endpoint,
                 device: simpy.PriorityResource, costs: StageCosts) -> None:
        self.env, self.spec, self.endpoint, self.device, self.costs = \
            env, spec, endpoint, device, costs
        # On a shared host, replicas yield to the training chain (INFERENCE_NICENESS).
        self.priority = 1 if spec.role == "inference" else 0
        self.alive = True
        self.version = 0  # the weights it serves (a replica) or trains (a training peer)
        self.busy: Counter[str] = Counter()  # compute seconds by purpose

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stage(self) -> int:
        return self.spec.stage

    def compute(self, seconds: float, purpose: str | None) -> Generator[Any, Any, None]:
        """`seconds` on the device, booked under `purpose` (None: the caller books them)."""
        if not self.alive:
            raise PeerGone(self.name)
        with self.device.request(priority=self.priority) as turn:
            yield turn
            yield self.env.timeout(seconds)
        if purpose is not None:
            self.busy[purpose] += seconds
        if not self.alive:
            raise PeerGone(self.name)


@dataclass
class Step:
    """A session's step waiting at a replica: `rows` rows of `positions` new positions each, at
    `context` positions already cached."""

    rows: int
    positions: int
    context: int
    purpose: str
    done: simpy.Event


class Replica(SimPeer):
    """An inference replica: sessions' steps queue, and run together (continuous batching)."""

    def __init__(self, env: simpy.Environment, spec: PeerSpec, endpoint: Endpoint,
                 device: simpy.PriorityResource, costs: StageCosts, swarm: SwarmConfig
                 ) -> None:
        super().__init__(env, spec, endpoint, device, costs)
        self.swarm = swarm
        self.queue: simpy.Store = simpy.Store(env)
        self.sessions = 0  # generation sessions open on it
        self.forwards = 0
        self.batched_rows = 0
        env.process(self._serve())

    def step(self, rows: int, positions: int, context: int, purpose: str = "generate"
             ) -> simpy.Event:
        """An event that fires when the step has run (fails with PeerGone if it cannot)."""
        done = self.env.event()
        if not self.alive:
            done.fail(PeerGone(self.name))
        else:
            self.queue.put(Step(rows, positions, context, purpose, done))
        return done

    def leave(self) -> None:
        self.alive = False
        for waiting in list(self.queue.items):
            waiting.done.fail(PeerGone(self.name))
        self.queue.items.clear()

    def _serve(self) -> Generator[Any, Any, None]:
        while True:
            first: Step = yield self.queue.get()
            batch = [first]
            if self.swarm.batching and self.swarm.batch_wait_s > 0:
                yield self.env.timeout(self.swarm.batch_wait_s)
            while self.swarm.batching and self.queue.items \
                    and sum(s.rows for s in batch) + self.queue.items[0].rows \
                    <= self.swarm.batch_max_rows:
                batch.append((yield self.queue.get()))
            rows = sum(s.rows for s in batch)
            seconds = self.costs.forward_s(
                rows, max(1, round(sum(s.rows * s.positions for s in batch) / rows))
                if any(s.positions > 1 for s in batch) else 1, max(s.context for s in batch))
            # A step samples one token per row; a re-execution scores every position.
            seconds += self.costs.sampling_s(sum(s.rows * s.positions if s.purpose == "verify"
                                                 else s.rows for s in batch))
            try:
                yield from self.compute(seconds, None)
            except PeerGone as gone:
                for step in batch:
                    step.done.fail(gone)
                return
            tokens = sum(s.rows * s.positions for s in batch)
            for step in batch:  # each purpose's share of the forward
                self.busy[step.purpose] += seconds * step.rows * step.positions / tokens
                step.done.succeed()
            self.forwards += 1
            self.batched_rows += sum(s.rows for s in batch)


class TrainingPeer(SimPeer):
    """A stage's training peer: forwards and backwards of micro-batches, an optimizer step."""

    def forward(self, tokens: int, rows: int, purpose: str = "train"
                ) -> Generator[Any, Any, None]:
        yield from self.compute(self.costs.train_forward_s(tokens, rows), purpose)

    def backward(self, tokens: int, rows: int, purpose: str = "train"
                 ) -> Generator[Any, Any, None]:
        yield from self.compute(self.costs.train_backward_s(tokens, rows), purpose)

    def optimizer_step(self, purpose: str = "train") -> Generator[Any, Any, None]:
        yield from self.compute(self.costs.optimizer_s(), purpose)

    def checkpoint(self) -> Generator[Any, Any, None]:
        yield from self.compute(self.costs.checkpoint_s(), "checkpoint")
