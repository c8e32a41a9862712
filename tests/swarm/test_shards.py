"""Checkpoint shards across hosts (release/shards.py): a training peer reports the shard it
saved (its stage's weights; the optimizer state stays on its disk), the coordinator signs the
manifest, fetches a shard its run folder lacks over the swarm (`checkpoint_shard`, coordinator
only, bounded), keeps it only if it hashes to what was signed, and `export` refuses a shard the
manifest disowns."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from swarm_helpers import start_node, start_swarm, tiny_run_config

from decentrl.coordinator.swarm_backend import SwarmBackend
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.loading import model_spec, resolve_model
from decentrl.model.run_stage import load_stage, stage_shapes
from decentrl.net.directory import SwarmUnavailable
from decentrl.net.identity import Identity
from decentrl.net.node import PeerRefused
from decentrl.net.protocol import CHECKPOINT_SHARD, SHARD_CHUNK_BYTES
from decentrl.net.training_messages import ShardChunk, ShardRequest
from decentrl.release.shards import (
    ShardError,
    ShardManifest,
    ShardRecord,
    check_shard,
    fetch_shard,
    manifest_path,
    missing_shards,
    read_manifest,
    reported_shard,
    shard_bytes_limit,
    write_manifest,
)
from tests.swarm.test_swarm import make_batch


@pytest.mark.network
def test_a_shard_on_another_disk_is_fetched_checked_and_refused_when_it_differs(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(tiny_sharp_dir, 1)
    with start_swarm(config, [(0, "training")]) as swarm:
        trainer = swarm.remote_trainer()
        trainer.train_step(make_batch(0))  # Adam's moments now hold twice the weights
        worker = trainer.workers[0]
        saved = worker.checkpoint("save", 1)
        peer_disk = CheckpointLayout(swarm.checkpoint_dir)
        peer_file = peer_disk.stage_file(1, 0)
        assert saved.shard_bytes == peer_file.stat().st_size > 2 * 64 * 2**10
        # The optimizer state is a file of its own on the peer's disk, not part of the shard.
        moments = torch.load(peer_disk.optimizer_file(1, 0), weights_only=True)["optimizer"]
        assert moments["state"]
        moment_bytes = sum(t.numel() * t.element_size() for each in moments["state"].values()
                           for t in each.values())
        weights = swarm.peer(0, "training").training.model.state_dict()
        weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        assert moment_bytes >= 2 * weight_bytes
        owner = swarm.client.identity
        record = ShardRecord(stage=0, peer=worker.peer or "", sha256=saved.shard_sha256,
                             bytes=saved.shard_bytes)
        # The coordinator's run folder is another disk: the manifest says what to fetch.
        run = CheckpointLayout(tmp_path / "checkpoints")
        write_manifest(run, ShardManifest(version=1, shards=[record]), owner)
        manifest = read_manifest(run, 1, owner.peer_id)
        assert manifest is not None and missing_shards(run, manifest) == [record]
        fetched: list[int] = []

        def counted(request: ShardRequest) -> tuple[ShardChunk, dict[str, torch.Tensor]]:
            reply, tensors = worker.shard_chunk(request)
            fetched.append(tensors["data"].numel())
            return reply, tensors
        with pytest.raises(ValueError, match="chunk_bytes must be in"):
            fetch_shard(counted, 1, record, run.stage_file(1, 0), chunk_bytes=0)
        fetch_shard(counted, 1, record, run.stage_file(1, 0), chunk_bytes=64 * 2**10)  # pieces
        assert run.stage_file(1, 0).read_bytes() == peer_file.read_bytes()
        assert missing_shards(run, manifest) == []
        # Only the weights came over: the learner's and the served copy, and a few KiB around.
        assert len(fetched) > 1 and sum(fetched) == record.bytes
        assert 2 * weight_bytes <= sum(fetched) < 2 * weight_bytes + moment_bytes // 4
        shard = torch.load(run.stage_file(1, 0), weights_only=True)
        assert sorted(shard) == ["served", "version", "weights"] and shard["version"] == 1
        assert not run.optimizer_file(1, 0).exists()
        # A shard that is not the one signed is not kept, nor exported.
        lying = ShardRecord(stage=0, peer=record.peer, sha256="0" * 64, bytes=record.bytes)
        with pytest.raises(ShardError, match="does not hash to what the run's owner signed"):
            fetch_shard(worker.shard_chunk, 1, lying, tmp_path / "other.pt")
        assert not (tmp_path / "other.pt").exists() and not (tmp_path / "other.part").exists()
        run.stage_file(1, 0).write_bytes(b"a shard copied by hand from somewhere")
        with pytest.raises(ShardError, match="is not the shard the run's owner signed"):
            check_shard(run.stage_file(1, 0), record)
        # Only the run's owner may sign the manifest.
        with pytest.raises(ShardError, match="not a shard manifest the run's owner signed"):
            read_manifest(run, 1, Identity.generate().peer_id)
        # The peer refuses a stretch too long (a strike), and a version it never saved.
        peer = swarm.peer(0, "training")
        with pytest.raises(PeerRefused, match="takes 1 to"):
            swarm.client.call_sync(peer.node.peer_id, CHECKPOINT_SHARD, ShardRequest(
                version=0, offset=0, count=SHARD_CHUNK_BYTES + 1))
        with pytest.raises(SwarmUnavailable, match="keeps no checkpoint at version 9"):
            worker.shard_chunk(ShardRequest(version=9, offset=0, count=10))
        # Nobody but the coordinator may fetch a shard: refused before it is read.
        stranger = start_node(config, "stranger", swarm.client.addresses(),
                              swarm.client.limits, swarm.client.link_profile)
        try:
            with pytest.raises(PeerRefused, match="checkpoint_shard"):
                stranger.call_sync(peer.node.peer_id, CHECKPOINT_SHARD,
                                   ShardRequest(version=0, offset=0, count=10))
        finally:
            stranger.shutdown()


@pytest.mark.network
def test_a_training_peer_that_reports_a_shard_larger_than_its_stage_can_be_is_refused(
        tiny_sharp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lying peer must not make the coordinator fetch an arbitrarily large file: its report is
    bounded by the stage's weights, and the checkpoint fails as if it had not answered."""
    config = tiny_run_config(tiny_sharp_dir, 1, host={"run_dir": str(tmp_path / "runs")})
    limit = shard_bytes_limit(stage_shapes(config, model_spec(resolve_model(config.model)), 0))
    with start_swarm(config, [(0, "training")]) as swarm:
        worker = swarm.workers()[0]
        honest = worker.checkpoint("save", 0)
        assert 0 < honest.shard_bytes <= limit
        training = swarm.peer(0, "training").training
        assert training is not None
        huge = 64 * 2**30
        monkeypatch.setattr(training, "_save", lambda version, committed: (
            honest.shard_sha256, huge))
        # The coordinator's own save, over the real RPC to the lying peer.
        coordinator = SimpleNamespace(checkpoints=CheckpointLayout(config.path / "checkpoints"),
                                      workers=[worker], shard_limits=[limit], node=swarm.client)
        with pytest.raises(SwarmUnavailable, match=(
                f"checkpoint v0: training peer {(worker.peer or '')[-8:]} reports a {huge}-byte "
                f"checkpoint shard for stage 0, whose weights take 1 to {limit} bytes: refused")):
            SwarmBackend.save_checkpoint(coordinator, 0, 0, 0)  # type: ignore[arg-type]
        # Nothing signed, nothing put in charge: the previous checkpoint (none here) stands.
        assert coordinator.checkpoints.latest_version() is None
        assert not manifest_path(coordinator.checkpoints, 0).exists()


def test_the_shard_limit_is_the_stages_weights_twice_with_a_margin(
        tiny_model_dir: Path) -> None:
    # A stage of 10^8 float32 values: its shard is 800 MB, refused past 1.5 times that.
    big = {"layer.weight": torch.empty(10**8, device="meta")}
    assert 8 * 10**8 < shard_bytes_limit(big) < int(1.51 * 8 * 10**8)
    # The shapes come from the run's stage as its peers build it, LoRA adapters included.
    config = tiny_run_config(tiny_model_dir, 2, train={"lora_rank": 2})
    shapes = stage_shapes(config, model_spec(resolve_model(config.model)), 1)
    built = load_stage(config, 1, torch.device("cpu"), torch.float32).state_dict()
    assert {name: t.shape for name, t in shapes.items()} == \
        {name: t.shape for name, t in built.items()}
    assert any(name.endswith(".lora_a") for name in shapes)
    # A report that cannot describe a shard of the stage is refused, naming what is wrong.
    with pytest.raises(ShardError, match="reports a 0-byte checkpoint shard for stage 1"):
        reported_shard(1, "12D3KooWpeer", "ab" * 32, 0, 100)
    with pytest.raises(ShardError, match="not 64 lowercase hex digits"):
        reported_shard(1, "12D3KooWpeer", "AB" * 32, 10, 100)
    assert reported_shard(1, "12D3KooWpeer", "ab" * 32, 100, 100).bytes == 100
