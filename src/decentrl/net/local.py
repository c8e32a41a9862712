"""The in-process transport: a bounded queue of rollout groups and a latest-weights slot per stage.
Used by single-machine runs and tests; the swarm's transport has the same methods."""

from __future__ import annotations

import queue
import threading

import torch

from decentrl.net.transport import TransportClosed
from decentrl.rollout.types import RolloutGroup


class LocalTransport:
    def __init__(self, max_queued_groups: int) -> None:
        if max_queued_groups < 1:
            raise ValueError(f"max_queued_groups must be >= 1, got {max_queued_groups}")
        # Bounded, so a fast actor blocks instead of running arbitrarily far ahead of the learner.
        self._groups: queue.Queue[RolloutGroup] = queue.Queue(maxsize=max_queued_groups)
        self._weights: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise TransportClosed("transport is closed")

    def put_rollouts(self, group: RolloutGroup, timeout: float) -> bool:
        self._check_open()
        try:
            self._groups.put(group, timeout=timeout)
            return True
        except queue.Full:
            return False

    def get_rollouts(self, timeout: float) -> RolloutGroup | None:
        self._check_open()
        try:
            return self._groups.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish_stage(self, stage: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._check_open()
        # A private copy: the trainer keeps stepping its own tensors after publishing.
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        with self._lock:
            current = self._weights.get(stage)
            if current is not None and version <= current[0]:
                raise ValueError(f"stage {stage} version {version} is not newer than the "
                                 f"published version {current[0]}")
            self._weights[stage] = (version, snapshot)

    def fetch_stage(self, stage: int, current_version: int
                    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        self._check_open()
        with self._lock:
            current = self._weights.get(stage)
        if current is None or current[0] == current_version:
            return None
        return current

    def close(self) -> None:
        self._closed.set()
