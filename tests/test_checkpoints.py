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


@pytest.mark.parametrize("pointer", ["../etc", "v", "v1x", "", "4"])
def test_a_malformed_latest_pointer_is_refused(tmp_path: Path, pointer: str) -> None:
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ValueError, match="should name a checkpoint folder like 'v12'"):
        CheckpointLayout(tmp_path).latest_version()
