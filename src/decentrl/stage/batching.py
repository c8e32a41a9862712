"""Continuous batching of inference steps on a stage peer.

Every session's step waits in one queue. One tick at a time runs on the node's compute thread
(net/compute.py, at generation priority, so training and spot-check work go first): it takes the
steps waiting at that moment, up to `max_rows` rows, and hands them to the inference service,
which runs them as one batched forward (stage/inference.py). Sessions join and leave between
ticks; a step that arrives while a tick runs goes in the next one.

The wait is bounded and only for steps about to arrive, on a peer kept busy. Each session's
turnaround (from the peer's answer to the session's next step: the client's work, and in a
pipeline the other stages and the network) is measured. A tick that starts within `wait_s` of
the previous one's end waits, at most `wait_s`, for the sessions answered earlier whose next
step is due within that time, and no longer than until they are all in; a tick on a peer that
was idle longer runs at once (it has time to spare, and waiting would only add latency). Without it, a session whose step came a few milliseconds late falls out of phase with
the others and runs in a tick of its own every time, which on a CPU costs most of a full tick
(the weights are read once per tick whatever the rows). A session that is not expected soon
(its step is crossing the network to another stage) is not waited for, so a peer in a pipeline
never idles for it, and a lone session runs at once."""

from __future__ import annotations

import asyncio
import logging
import math
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
    turnaround: float | None = None  # its session's, a moving average (None: not measured yet)

    @property
    def session(self) -> SessionKey:
        return self.request.sender, self.request.body.session

    @property
    def rows(self) -> int:
        return self.request.body.batch


# A session's key: (the peer that opened it, the id it chose).
SessionKey = tuple[str, str]

# What a tick's runner returns for each step, in order: its reply or the error it fails with.
Outcome = Reply | BaseException
TickRunner = Callable[[list[StepRequest]], list[Outcome]]


# A session answered this long ago that never came back (its client crashed, or left without
# closing it) is no longer expected.
FORGET_AFTER_S = 30.0
# Weight of a new measurement in a session's turnaround average.
TURNAROUND_WEIGHT = 0.3

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
        # Guards everything below but the counters (compute thread only).
        self._arrivals = threading.Condition()
        self._waiting: deque[QueuedStep] = deque()
        self._tick_queued = False
        # Sessions answered and not back yet: when, and their turnaround (seconds, a moving
        # average; None until measured).
        self._out: dict[SessionKey, tuple[float, float | None]] = {}
        self._last_tick_end = -math.inf
        self.ticks = 0
        self.rows = 0  # rows run by all ticks

    async def submit(self, sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]
                     ) -> Reply:
        """Queue one step (on the node's loop) and wait for its tick to answer it."""
        step = QueuedStep(StepRequest(sender, body, tensors), self.node.loop.create_future())
        with self._arrivals:
            out = self._out.pop(step.session, None)
            if out is not None:
                answered, before = out
                took = step.arrived - answered
                step.turnaround = took if before is None \
                    else before + TURNAROUND_WEIGHT * (took - before)
            self._waiting.append(step)
            self._arrivals.notify()
            start_tick = not self._tick_queued
            self._tick_queued = True
        if start_tick:
            self._queue_tick()
        return await step.reply

    def forget(self, sender: str, session: str) -> None:
        """A closed session: none of its steps will come."""
        with self._arrivals:
            self._out.pop((sender, session), None)

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
        answered = time.monotonic()
        with self._arrivals:
            self._last_tick_end = answered
            for step, outcome in zip(batch, outcomes, strict=True):
                if not isinstance(outcome, BaseException):  # the session moved on
                    self._out[step.session] = (answered, step.turnaround)
        for step, outcome in zip(batch, outcomes, strict=True):
            self.node.loop.call_soon_threadsafe(_answer, step.reply, outcome)

    def _take(self) -> list[QueuedStep]:
        """The steps of this tick, after waiting for those due within `wait_s`; queues the next
        tick if steps are left over."""
        with self._arrivals:
            now = time.monotonic()
            deadline = now + self.wait_s
            # Only a peer that is kept busy waits: one that was idle has time to spare for the
            # steps to come, and a wait would only add to this step's latency.
            busy = now - self._last_tick_end <= self.wait_s
            while busy and self._waiting and not self._full() and self._due_before(deadline):
                self._arrivals.wait(deadline - time.monotonic())
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
            self._tick_queued = bool(self._waiting)
        if self._tick_queued:
            self._queue_tick()
        return batch

    def _full(self) -> bool:
        """Whether the waiting steps fill a tick (under the lock)."""
        if self.max_steps is not None and len(self._waiting) >= self.max_steps:
            return True
        return sum(step.rows for step in self._waiting) >= self.max_rows

    def _due_before(self, deadline: float) -> bool:
        """Whether a session answered earlier is expected back before `deadline` (under the
        lock); forgets sessions gone for good."""
        now = time.monotonic()
        if now >= deadline:
            return False
        due = False
        for key, (answered, turnaround) in list(self._out.items()):
            if now - answered > FORGET_AFTER_S:
                del self._out[key]
            elif turnaround is not None and answered + turnaround < deadline:
                due = True
        return due


def _answer(reply: asyncio.Future[Reply], outcome: Outcome) -> None:
    if reply.done():
        return
    if isinstance(outcome, BaseException):
        reply.set_exception(outcome)
    else:
        reply.set_result(outcome)
