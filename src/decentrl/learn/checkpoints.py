"""The layout of a run's checkpoints, owned here and nowhere else:

    checkpoints/latest                      "v<N>": the newest complete checkpoint
    checkpoints/v<N>/stage<i>.pt            stage i's weights at version N: the learner's and, from
                                            a training peer, what its replicas served. All that
                                            `decentrl export` reads: the shard a release fetches
                                            from a training peer on another host
    checkpoints/v<N>/stage<i>.optimizer.pt  stage i's optimizer state at version N (Adam's moments:
                                            twice the weights). Only resuming training reads it,
                                            so it stays on the disk of whoever trains the stage
    checkpoints/v<N>/trainer.json           the local trainer's bookkeeping (a swarm run keeps it
                                            in SQLite)

Both files of a stage are written by whoever trains it (the local trainer, or the stage's training
peer). A checkpoint becomes the one in charge only when `latest` is renamed onto it, after every
stage is written, so a crash mid-save leaves the previous one in charge."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"
META_FILE = "trainer.json"
# The key of a stage's training state (StageTrainer.state) that goes to the optimizer file.
OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class CheckpointLayout:
    root: Path  # a run's checkpoints/ folder

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def stage_file(self, version: int, stage: int) -> Path:
        """Stage `stage`'s weights at `version`: what an export reads."""
        return self.folder(version) / f"stage{stage}.pt"

    def optimizer_file(self, version: int, stage: int) -> Path:
        """Stage `stage`'s optimizer state at `version`: what resuming its training also reads."""
        return self.folder(version) / f"stage{stage}.{OPTIMIZER}.pt"

    def meta_file(self, version: int) -> Path:
        return self.folder(version) / META_FILE

    def write_stage(self, version: int, stage: int, state: dict[str, Any]) -> Path:
        """Write stage `stage`'s training state at `version` (a StageTrainer's `state()`, with
        whatever else the weights file should carry) as its two files; returns the weights file.
        Each file is written under another name and renamed into place: a crash mid-save leaves
        no half-written file."""
        if state.get("version") != version or OPTIMIZER not in state:
            raise ValueError(f"stage {stage}'s state to save at version {version} must hold "
                             f"its '{OPTIMIZER}' and version {version}, not keys {sorted(state)} "
                             f"at version {state.get('version')}")
        weights = {key: value for key, value in state.items() if key != OPTIMIZER}
        self.folder(version).mkdir(parents=True, exist_ok=True)
        _save(self.optimizer_file(version, stage), {OPTIMIZER: state[OPTIMIZER],
                                                     "version": version})
        path = self.stage_file(version, stage)
        _save(path, weights)
        return path

    def read_stage(self, version: int, stage: int, device: torch.device) -> dict[str, Any]:
        """Stage `stage`'s training state at `version`, both files of it, as `write_stage` was
        given it. FileNotFoundError names a file that is missing, ValueError one that holds
        another version."""
        paths = (self.stage_file(version, stage), self.optimizer_file(version, stage))
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {self.folder(version)} has no {path.name}")
        weights, optimizer = (torch.load(path, map_location=device, weights_only=True)
                              for path in paths)
        for path, part in zip(paths, (weights, optimizer), strict=True):
            if part.get("version") != version:
                raise ValueError(f"{path} holds version {part.get('version')}, the checkpoint "
                                 f"is version {version}")
        return {**weights, OPTIMIZER: optimizer[OPTIMIZER]}

    def latest_version(self) -> int | None:
        """The version `latest` points at; None before the first checkpoint."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        text = pointer.read_text().strip()
        if not (text.startswith("v") and text[1:].isdigit()):
            raise ValueError(f"{pointer} should name a checkpoint folder like 'v12', "
                             f"not {text[:40]!r}")
        return int(text[1:])

    def latest(self) -> Path | None:
        """The folder of the newest complete checkpoint, None when there is none."""
        version = self.latest_version()
        return None if version is None else self.folder(version)

    def prune_stage(self, stage: int, older_than: int) -> None:
        """Delete stage `stage`'s files of checkpoints older than `older_than` (a training peer
        on a disk of its own, told which checkpoint the coordinator last committed: a rollback
        goes there, never further back)."""
        versions = [int(folder.name[1:]) for folder in self.root.glob("v*")
                    if folder.name[1:].isdigit()]
        for version in (v for v in versions if v < older_than):
            self.stage_file(version, stage).unlink(missing_ok=True)
            self.optimizer_file(version, stage).unlink(missing_ok=True)
            try:
                self.folder(version).rmdir()  # gone once every stage's files are
            except OSError:
                pass

    def commit(self, version: int) -> None:
        """Put checkpoint `version` in charge (atomically) and delete every older one."""
        pointer = self.root / LATEST
        staging = pointer.with_suffix(".tmp")
        staging.write_text(f"v{version}")
        os.replace(staging, pointer)
        kept = self.folder(version)
        for old in self.root.glob("v*"):
            if old.is_dir() and old != kept:
                shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(root: Path, version: int, states: dict[int, dict[str, Any]],
                     extra: dict[str, Any]) -> Path:
    """Write every stage's training state (by stage index) of `version` under `root`, with the
    local trainer's bookkeeping `extra`, then put the checkpoint in charge; its folder."""
    layout = CheckpointLayout(root)
    folder = layout.folder(version)
    folder.mkdir(parents=True, exist_ok=True)
    for stage, state in states.items():
        layout.write_stage(version, stage, state)
    layout.meta_file(version).write_text(json.dumps({"version": version, **extra}))
    layout.commit(version)
    return folder


def read_checkpoint(root: Path, stages: list[int], device: torch.device
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The checkpoint in charge under `root`: its bookkeeping and each of `stages`' training
    state, all read and checked before the caller loads any (a bad checkpoint changes nothing)."""
    layout = CheckpointLayout(root)
    version = layout.latest_version()
    if version is None:
        raise FileNotFoundError(f"{root} holds no checkpoint (no 'latest' pointer)")
    meta = layout.meta_file(version)
    if not meta.is_file():
        raise FileNotFoundError(f"checkpoint {layout.folder(version)} has no {meta.name}")
    states = [layout.read_stage(version, stage, device) for stage in stages]
    info = json.loads(meta.read_text())
    if info["version"] != version:
        raise ValueError(f"{meta} describes version {info['version']}, the checkpoint is "
                         f"version {version}")
    return info, states


def _save(path: Path, value: dict[str, Any]) -> None:
    staging = path.with_suffix(".tmp")
    torch.save(value, staging)
    os.replace(staging, path)
