"""Seeded prompt scheduling: the coordinator, not a peer, decides which problems are generated
(so no peer can pick easy ones), and it accepts groups only for problems it handed out."""

from __future__ import annotations

import threading


class PromptScheduler:
    def __init__(self, seed: int, start: int = 0) -> None:
        # Disjoint index streams per seed: two runs with different seeds train on different items.
        self.offset = seed * 1_000_003
        self._next = start
        self._issued: set[int] = set()
        self._lock = threading.Lock()

    def next(self, count: int) -> list[int]:
        with self._lock:
            indices = [self.offset + self._next + i for i in range(count)]
            self._next += count
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
        """How many problems were handed out (checkpointed, so a resumed run continues the stream)."""
        return self._next
