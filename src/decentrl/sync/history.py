"""A replica's last few weight updates, kept so it can rewind its served weights to a recent
version and re-execute someone else's rollout there (a spot-check), then come back.

Each committed update is remembered by what it wrote (`TensorChange`: entries, new and old
float32 values), not by a copy of the tensors: a sparse update costs 16 bytes per changed entry
(int64 index, two float32 values). The served model holds every entry as the compute-dtype cast
of the published float32 value, and the old values are the published values from before the
update, so writing them back (cast the same way) restores the earlier weights bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager

import torch

from decentrl.errors import DecentrlError
from decentrl.sync.delta import TensorChange

Changes = Mapping[str, TensorChange]


class VersionUnavailable(DecentrlError, ValueError):
    """The weights of a requested version cannot be rebuilt here."""


class UpdateHistory:
    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep = keep
        self.updates: deque[tuple[int, Changes]] = deque(maxlen=keep)  # (version after, changes)

    def record(self, version: int, changes: Changes) -> None:
        """After committing the update that made `version`. A keyframe (a change with no indices)
        rewrites every entry: keeping its undo would cost a whole copy of the stage, so the
        history starts over. So does an update that does not follow the last one recorded (the
        weights were replaced some other way in between)."""
        if any(change.indices is None for change in changes.values()):
            self.clear()
            return
        if self.updates and version != self.updates[-1][0] + 1:
            self.clear()
        self.updates.append((version, changes))

    def clear(self) -> None:
        """Forget every update: call it when the served weights are replaced wholesale."""
        self.updates.clear()

    def oldest_version(self, current: int) -> int:
        """The oldest version the weights at `current` can be rewound to."""
        if not self.updates or self.updates[-1][0] != current:
            return current
        return self.updates[0][0] - 1

    @property
    def nbytes(self) -> int:
        """Memory held by the recorded updates."""
        return sum(tensor.nbytes for _, changes in self.updates for change in changes.values()
                   for tensor in (change.indices, change.values, change.old)
                   if tensor is not None)

    def rewound(self, params: Mapping[str, torch.Tensor], current_version: int, target: int
                ) -> AbstractContextManager[None]:
        """A context in which `params` (the served model's, at `current_version`) hold the
        weights of version `target`; they are restored exactly on exit, also on an exception.
        Raises VersionUnavailable now, before anything is written, if `target` is out of reach."""
        oldest = self.oldest_version(current_version)
        if not oldest <= target <= current_version:
            raise VersionUnavailable(
                f"cannot rewind weights at version {current_version} to version {target}: "
                f"versions {oldest}..{current_version} are available")
        undone = [changes for version, changes in self.updates if version > target]
        missing = {name for changes in undone for name in changes} - set(params)
        if missing:
            raise ValueError(f"the recorded updates change tensors the model lacks: "
                             f"{sorted(missing)[:3]}")
        return _rewound(params, undone)


@contextmanager
def _rewound(params: Mapping[str, torch.Tensor], undone: list[Changes]) -> Iterator[None]:
    try:
        with torch.no_grad():
            for changes in reversed(undone):  # newest first: each finds its own new values
                for name, change in changes.items():
                    change.write(params[name], change.old)
        yield
    finally:
        # Replaying every update oldest first restores the current weights whatever state a
        # failure left them in: each entry's last write is its newest update's new value.
        with torch.no_grad():
            for changes in undone:
                for name, change in changes.items():
                    change.write(params[name], change.values)
