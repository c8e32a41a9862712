"""A node's compute thread: one thread runs every piece of blocking work (forward passes, training
steps, weight updates) one at a time, taking the most urgent waiting piece first.

One thread, so a weight update written between two pieces is never seen half-applied by a
forward pass. Priorities, because a peer may serve several roles: the training chain is the
critical path of a step (every sample waits for it), a spot-check holds a group back from
training, and generation is what fills the rest; a weight update comes before generation so the
sessions move to the new version at the next tick. Within one priority, first come first served.
Work that is already running is never interrupted: a low-priority piece delays an urgent one by
at most its own length (one batched generation tick)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from enum import IntEnum
from typing import Any, TypeVar

from decentrl.net.protocol import ComputeTime

T = TypeVar("T")


class Priority(IntEnum):
    """Lower runs first."""

    TRAINING = 0
    WEIGHTS = 1
    VERIFICATION = 2
    GENERATION = 3


class ComputeThread:
    """A single worker thread over a priority queue of work."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._queue: list[tuple[int, int, Callable[[], Any], Future[Any]]] = []
        self._order = itertools.count()
        self._wakeup = threading.Condition()
        self._closed = False
        self._initializer = initializer
        self.started = time.monotonic()
        # Seconds spent running work of each priority (read from any thread: a snapshot).
        self.busy_s = dict.fromkeys(Priority, 0.0)
        self._thread = threading.Thread(target=self._run, name=f"compute-{name}", daemon=True)
        self._thread.start()

    def submit(self, priority: Priority, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._wakeup:
            if self._closed:
                raise RuntimeError("the compute thread is shut down")
            heapq.heappush(self._queue, (priority, next(self._order), lambda: fn(*args), future))
            self._wakeup.notify()
        return future

    def usage(self) -> ComputeTime:
        """Seconds spent on each kind of work so far, and alive."""
        busy = dict(self.busy_s)
        return ComputeTime(training_s=round(busy[Priority.TRAINING], 3),
                           weights_s=round(busy[Priority.WEIGHTS], 3),
                           verification_s=round(busy[Priority.VERIFICATION], 3),
                           generation_s=round(busy[Priority.GENERATION], 3),
                           alive_s=round(time.monotonic() - self.started, 3))

    def shutdown(self) -> None:
        """Stop taking work; cancel what waits (the piece running finishes on its own)."""
        with self._wakeup:
            self._closed = True
            waiting, self._queue = self._queue, []
            self._wakeup.notify()
        for *_, future in waiting:
            future.cancel()

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            with self._wakeup:
                while not self._queue and not self._closed:
                    self._wakeup.wait()
                if self._closed:
                    return
                priority, _, work, future = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            began = time.monotonic()
            try:
                result = work()
            except BaseException as error:  # noqa: BLE001 - handed to whoever awaits the work
                future.set_exception(error)
            else:
                future.set_result(result)
            finally:
                self.busy_s[Priority(priority)] += time.monotonic() - began
