"""Seeded prompt scheduling: the coordinator, not a peer, decides which problems are generated
(so no peer can pick easy ones), and it accepts groups only for problems it handed out.

The stream of candidate indices is fixed by the run's seed; `admits` (the curriculum,
swarm/curriculum.py) may pass over a candidate, which is then never handed out. The position
counts candidates, handed out or passed over, and is reserved durably before the chosen indices
are returned."""

from __future__ import annotations

import threading
from collections.abc import Callable


class PromptScheduler:
    def __init__(self, seed: int, start: int = 0,
                 admits: Callable[[int], bool] | None = None) -> None:
        # Disjoint index streams per seed: two runs with different seeds train on different items.
        self.offset = seed * 1_000_003
        self._next = start
        self._admits = admits
        self._issued: set[int] = set()
        self._lock = threading.Lock()

    def next(self, count: int, reserve: Callable[[int], list[int]] | None = None) -> list[int]:
        """The next `count` indices handed out. `reserve(n)` is called with the candidates they
        took before they are returned (the run store's `reserve_problems`: durable first) and
        must return their positions."""
        with self._lock:
            indices: list[int] = []
            position = self._next
            while len(indices) < count:
                index = self.offset + position
                if self._admits is None or self._admits(index):
                    indices.append(index)
                position += 1
            if reserve is not None and position > self._next:
                first = reserve(position - self._next)[0]
                if first != self._next:
                    raise RuntimeError(f"the scheduler is at problem position {self._next} but "
                                       f"the store reserved from {first}: two schedulers share "
                                       "the run")
            self._next = position
            self._issued.update(indices)
        return indices

    def take(self, index: int) -> bool:
        """Accept a result for `index` once: False if it was never issued or is already taken."""
        with self._lock:
            if index not in self._issued:
                return False
            self._issued.remove(index)
            return True

    @property
    def position(self) -> int:
        """How many candidates were handed out or passed over (checkpointed, so a resumed run
        continues the stream)."""
        return self._next
