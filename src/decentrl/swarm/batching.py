"""Continuous batching of inference steps on a stage peer.

Every session's step waits in one queue. One tick at a time runs on the node's compute thread
(net/compute.py, at generation priority, so training and spot-check work go first): it takes the
steps waiting at that moment, up to `max_rows` rows, and hands them to the inference service,
which runs them as one batched forward (swarm/inference.py). Sessions join and leave between
ticks; a step that arrives while a tick runs goes in the next one.

The wait is bounded: a tick that finds fewer rows waiting than the previous tick took waits for
the others at most `wait_s` after its oldest step arrived, then runs with what it has. One
session is never held back for long by others, and a peer that serves one session runs it at
once (the previous tick had no more rows to wait for)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decentrl.net.compute import Priority
from decentrl.net.node import Reply, SwarmNode
from decentrl.net.protocol import InferenceStep

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRequest:
    """One step of a sender's session, as it arrived."""

    sender: str
    body: InferenceStep
    tensors: dict[str, torch.Tensor]


@dataclass
class QueuedStep:
    """A step waiting for a tick, and where its reply goes."""

    request: StepRequest
    reply: asyncio.Future[Reply]
    arrived: float = field(default_factory=time.monotonic)

    @property
    def rows(self) -> int:
        return self.request.body.batch


# What a tick's runner returns for each step, in order: its reply or the error it fails with.
Outcome = Reply | BaseException
TickRunner = Callable[[list[StepRequest]], list[Outcome]]


class StepBatcher:
    """The queue of a peer's inference steps and its ticks."""

    def __init__(self, node: SwarmNode, run_tick: TickRunner, max_rows: int, wait_s: float,
                 max_steps: int | None = None) -> None:
        """`max_steps`: steps a tick takes at most (1: one request at a time, no batching)."""
        if max_rows < 1 or wait_s < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"need max_rows >= 1, wait_s >= 0 and max_steps >= 1; got "
                             f"{max_rows}, {wait_s}, {max_steps}")
        self.node, self.run_tick = node, run_tick
        self.max_rows, self.wait_s, self.max_steps = max_rows, wait_s, max_steps
        self._waiting: deque[QueuedStep] = deque()
        self._arrivals = threading.Condition()  # guards _waiting, _tick_queued, _last_rows
        self._tick_queued = False
        self._last_rows = 0
        self.ticks = 0
        self.rows = 0  # rows run by all ticks

    async def submit(self, sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]
                     ) -> Reply:
        """Queue one step (on the node's loop) and wait for its tick to answer it."""
        step = QueuedStep(StepRequest(sender, body, tensors), self.node.loop.create_future())
        with self._arrivals:
            self._waiting.append(step)
            self._arrivals.notify()
            start_tick = not self._tick_queued
            self._tick_queued = True
        if start_tick:
            self._queue_tick()
        return await step.reply

    @property
    def rows_per_tick(self) -> float:
        return self.rows / self.ticks if self.ticks else 0.0

    def _queue_tick(self) -> None:
        self.node.compute_thread.submit(Priority.GENERATION, self._tick)

    def _tick(self) -> None:
        """One tick (compute thread): gather, run, answer. Never raises: a failure is the
        answer of the steps it concerns."""
        batch = self._take()
        if not batch:
            return
        try:
            outcomes = self.run_tick([step.request for step in batch])
        except Exception as error:  # every step of the tick gets it
            log.exception("a batched inference tick failed")
            outcomes = [error] * len(batch)
        self.ticks += 1
        self.rows += sum(step.rows for step in batch)
        for step, outcome in zip(batch, outcomes, strict=True):
            self.node.loop.call_soon_threadsafe(_answer, step.reply, outcome)

    def _take(self) -> list[QueuedStep]:
        """The steps of this tick, after the bounded wait; queues the next tick if steps are
        left over."""
        with self._arrivals:
            if self._waiting:
                wanted = min(self.max_rows, self._last_rows)
                deadline = self._waiting[0].arrived + self.wait_s
                while sum(step.rows for step in self._waiting) < wanted:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._limit_reached():
                        break
                    self._arrivals.wait(left)
            batch: list[QueuedStep] = []
            rows = 0
            while self._waiting and (not batch or rows + self._waiting[0].rows <= self.max_rows):
                if self.max_steps is not None and len(batch) >= self.max_steps:
                    break
                step = self._waiting.popleft()
                if step.reply.cancelled():  # its caller gave up (a timeout); nobody waits
                    continue
                batch.append(step)
                rows += step.rows
            self._last_rows = rows
            self._tick_queued = bool(self._waiting)
        if self._tick_queued:
            self._queue_tick()
        return batch

    def _limit_reached(self) -> bool:
        return self.max_steps is not None and len(self._waiting) >= self.max_steps


def _answer(reply: asyncio.Future[Reply], outcome: Outcome) -> None:
    if reply.done():
        return
    if isinstance(outcome, BaseException):
        reply.set_exception(outcome)
    else:
        reply.set_result(outcome)
