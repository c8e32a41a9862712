"""The checkpoint layout (learn/checkpoints.py): `latest` is read strictly and moved atomically,
and committing a checkpoint removes the older ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from decentrl.learn.checkpoints import CheckpointLayout


def test_commit_puts_a_checkpoint_in_charge_and_removes_older_ones(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    assert layout.latest() is None and layout.latest_version() is None
    for version in (2, 4):
        layout.stage_file(version, 0).parent.mkdir(parents=True)
        layout.stage_file(version, 0).write_bytes(b"stage 0")
    layout.commit(4)
    assert layout.latest_version() == 4 and layout.latest() == tmp_path / "v4"
    assert layout.stage_file(4, 0).is_file() and not (tmp_path / "v2").exists()
    assert not (tmp_path / "latest.tmp").exists()


def test_a_training_peer_on_its_own_disk_drops_only_what_is_older_than_the_committed_one(
        tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    for version in (2, 4, 6):
        for stage in (0, 1):
            layout.stage_file(version, stage).parent.mkdir(parents=True, exist_ok=True)
            layout.stage_file(version, stage).write_bytes(b"shard")
    layout.prune_stage(0, older_than=4)  # v4 committed, v6 saved: a rollback goes to v4
    assert not layout.stage_file(2, 0).exists() and layout.stage_file(2, 1).is_file()
    assert layout.stage_file(4, 0).is_file() and layout.stage_file(6, 0).is_file()
    layout.prune_stage(1, older_than=4)
    assert not (tmp_path / "v2").exists()  # the folder goes with its last file


@pytest.mark.parametrize("pointer", ["../etc", "v", "v1x", "", "4"])
def test_a_malformed_latest_pointer_is_refused(tmp_path: Path, pointer: str) -> None:
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ValueError, match="should name a checkpoint folder like 'v12'"):
        CheckpointLayout(tmp_path).latest_version()
