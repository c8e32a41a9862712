"""The layout of a run's checkpoints, owned here and nowhere else:

    checkpoints/latest            "v<N>": the newest complete checkpoint
    checkpoints/v<N>/stage<i>.pt  stage i's trainer state at version N (written by whoever trains it:
                                  the local trainer, or the stage's training peer)
    checkpoints/v<N>/trainer.json the local trainer's bookkeeping (a swarm run keeps it in SQLite)

A checkpoint becomes the one in charge only when `latest` is renamed onto it, after every stage
is written, so a crash mid-save leaves the previous one in charge."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
META_FILE = "trainer.json"


@dataclass(frozen=True)
class CheckpointLayout:
    root: Path  # a run's checkpoints/ folder

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def stage_file(self, version: int, stage: int) -> Path:
        return self.folder(version) / f"stage{stage}.pt"

    def meta_file(self, version: int) -> Path:
        return self.folder(version) / META_FILE

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
            try:
                self.folder(version).rmdir()  # gone once every stage's file is
            except OSError:
                pass
            try:
                self.folder(version).rmdir()  # gone once every stage's file is
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
