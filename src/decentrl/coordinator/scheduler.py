"""Seeded prompt scheduling: the coordinator, not a peer, decides which problems are generated
(so no peer can pick easy ones), and it accepts groups only for problems it handed out.

The stream of candidate indices is fixed by the run's seed; `admits` (the curriculum,
coordinator/curriculum.py) may pass over a candidate, which is then never handed out. The position
counts candidates, handed out or passed over, and is reserved durably before the chosen indices
are returned.

`replay` (the curriculum's too) may instead hand out again a problem whose group was accepted
before. A replay gets an index of its own, `replay_index(source, attempt)`, so that its group has
its own id and sampling seed; `source_index` maps any handed-out index back to the problem of the
seeded stream it stands for (every `task.problem("train", ...)` of a scheduled index goes through
it). Replays take no position: the stream is unchanged by them."""

from __future__ import annotations

import threading
from collections.abc import Callable

# Past every index of a seeded stream (seed < 2^31: seed * 1_000_003 + position < 2^52 for any
# position a run reaches), so a replay's index is never a fresh one of any run.
REPLAY_STRIDE = 2**52


def replay_index(source: int, attempt: int) -> int:
    """The index under which problem `source` of the stream is handed out for the `attempt`-th
    time after its first (attempt >= 1)."""
    if not 0 <= source < REPLAY_STRIDE or attempt < 1:
        raise ValueError(f"no replay index for problem {source}, attempt {attempt}")
    return source + attempt * REPLAY_STRIDE


def source_index(index: int) -> int:
    """The stream's index of the problem a handed-out index stands for (itself if not a replay)."""
    return index % REPLAY_STRIDE


def replay_attempt(index: int) -> int:
    """0 for a problem's first hand-out, k for its k-th replay."""
    return index // REPLAY_STRIDE


class PromptScheduler:
    def __init__(self, seed: int, start: int = 0,
                 admits: Callable[[int], bool] | None = None,
                 replay: Callable[[], int | None] | None = None) -> None:
        # Disjoint index streams per seed: two runs with different seeds train on different items.
        self.offset = seed * 1_000_003
        self._next = start
        self._admits = admits
        self._replay = replay
        self._issued: set[int] = set()
        self._lock = threading.Lock()

    def next(self, count: int, reserve: Callable[[int], list[int]] | None = None) -> list[int]:
        """The next `count` indices handed out: for each, a replay where `replay` offers one,
        else the stream's next admitted candidate. `reserve(n)` is called with the candidates
        they took before they are returned (the run store's `reserve_problems`: durable first) and
        must return their positions."""
        with self._lock:
            indices: list[int] = []
            position = self._next
            while len(indices) < count:
                replayed = self._replay() if self._replay is not None else None
                if replayed is not None:
                    indices.append(replayed)
                    continue
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
