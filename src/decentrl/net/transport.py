"""The transport interfaces. Rollout groups flow from the inference side to the coordinator;
stage weights flow from the trainers to the inference replicas, versioned, one stage at a time.
In one process (`LocalTransport`) one object carries both; over the swarm rollouts go through
`HivemindTransport` and weights through their own protocol (sync/distribute.py). Every blocking
call takes a timeout, so no caller can wait forever on a peer that went away."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from decentrl.errors import DecentrlError
from decentrl.rollout.types import RolloutGroup


class TransportClosed(DecentrlError, RuntimeError):
    """The other side shut the transport down; stop the loop that uses it."""


class RolloutTransport(Protocol):
    def put_rollouts(self, group: RolloutGroup, timeout: float) -> bool:
        """Hand a group to the coordinator; False when it could not be queued within `timeout`."""
        ...

    def get_rollouts(self, timeout: float) -> RolloutGroup | None:
        """The next group, or None after `timeout` seconds without one."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(RolloutTransport, Protocol):
    """Rollouts and weights in one (the in-process transport)."""

    def publish_stage(self, stage: int, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make `version` of a stage's weights the one replicas should run."""
        ...

    def fetch_stage(self, stage: int, current_version: int
                    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The latest published weights of a stage if their version differs from the caller's
        `current_version`, else None. "Differs", not "is newer": a trainer that rolls back to a
        checkpoint publishes an older version, and replicas must follow it."""
        ...
