"""The checkpoint layout (learn/checkpoints.py): a stage's weights and its optimizer state are
separate files (a release fetches only the weights), `latest` is read strictly and moved
atomically, and committing a checkpoint removes the older ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
            layout.optimizer_file(version, stage).write_bytes(b"moments")
    layout.prune_stage(0, older_than=4)  # v4 committed, v6 saved: a rollback goes to v4
    assert not layout.stage_file(2, 0).exists() and layout.stage_file(2, 1).is_file()
    assert not layout.optimizer_file(2, 0).exists() and layout.optimizer_file(2, 1).is_file()
    assert layout.stage_file(4, 0).is_file() and layout.stage_file(6, 0).is_file()
    layout.prune_stage(1, older_than=4)
    assert not (tmp_path / "v2").exists()  # the folder goes with its last file


@pytest.mark.parametrize("pointer", ["../etc", "v", "v1x", "", "4"])
def test_a_malformed_latest_pointer_is_refused(tmp_path: Path, pointer: str) -> None:
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(ValueError, match="should name a checkpoint folder like 'v12'"):
        CheckpointLayout(tmp_path).latest_version()


def stage_state(version: int) -> dict[str, object]:
    """A StageTrainer's `state()` in miniature, with served weights as a training peer adds."""
    weights = {"layer.weight": torch.arange(6.0).reshape(2, 3)}
    moments = {"state": {0: {"exp_avg": torch.ones(2, 3), "exp_avg_sq": torch.ones(2, 3),
                             "step": torch.tensor(3.0)}}, "param_groups": [{"params": [0]}]}
    return {"weights": weights, "optimizer": moments, "version": version,
            "served": {"layer.weight": weights["layer.weight"] + 1}}


def test_a_stages_weights_and_optimizer_state_are_separate_files(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    state = stage_state(3)
    path = layout.write_stage(3, 1, state)
    # The weights file is what an export reads and a release fetches: no optimizer state in it.
    assert path == layout.stage_file(3, 1) == tmp_path / "v3" / "stage1.pt"
    weights = torch.load(path, weights_only=True)
    assert sorted(weights) == ["served", "version", "weights"]
    assert layout.optimizer_file(3, 1) == tmp_path / "v3" / "stage1.optimizer.pt"
    assert sorted(p.name for p in (tmp_path / "v3").iterdir()) == ["stage1.optimizer.pt",
                                                                   "stage1.pt"]
    # Resuming reads both, as they were written.
    read = layout.read_stage(3, 1, torch.device("cpu"))
    assert sorted(read) == sorted(state)
    assert torch.equal(read["optimizer"]["state"][0]["exp_avg_sq"], torch.ones(2, 3))
    assert torch.equal(read["served"]["layer.weight"], state["served"]["layer.weight"])
    # A missing file, or one of another version, is named.
    layout.write_stage(4, 1, stage_state(4))
    layout.optimizer_file(4, 1).replace(layout.optimizer_file(3, 1))
    with pytest.raises(ValueError, match=r"stage1\.optimizer\.pt holds version 4, the "
                                         "checkpoint is version 3"):
        layout.read_stage(3, 1, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match=r"has no stage1\.optimizer\.pt"):
        layout.read_stage(4, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="must hold its 'optimizer' and version 5"):
        layout.write_stage(5, 1, stage_state(4))
