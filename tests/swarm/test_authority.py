"""A run has an owner, and roles are granted (net/authority.py, coordinator/manifest.py,
coordinator/lineage.py): each attack of a stranger on the swarm, from a fresh identity that is not
the coordinator, against a live swarm of tiny models. Every attack is refused with an error that
names the method and the rule, the honest run's state (weights, micro-batches, versions, the
directory, strikes against honest peers) is unchanged, and training goes on."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from swarm_helpers import Swarm, start_node, start_swarm, tiny_run_config, weights_of

from decentrl.config import HostConfig, LinkConfig, RunConfig
from decentrl.coordinator import manifest as manifest_module
from decentrl.coordinator.manifest import (
    ManifestMismatch,
    accept_manifest,
    admit,
    admitted_peers,
    check_stage_files,
    config_hash,
    run_manifest,
)
from decentrl.learn.stage_loss import LossInputs
from decentrl.learn.stage_trainer import Activations
from decentrl.net.calls import TRUNCATED_REPLY_RETRIES
from decentrl.net.evidence import EvidenceRequest
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, SwarmNode
from decentrl.net.protocol import (
    CHECKPOINT,
    CLOSE_SESSION,
    INFERENCE_STEP,
    RPCS,
    SYNC_PLAN,
    TRAIN_BACKWARD,
    TRAIN_DISCARD,
    TRAIN_FORWARD,
    TRAIN_GRAD_NORM,
    TRAIN_PUBLISHED,
    TRAIN_STATE,
    TRAIN_STEP,
    VERIFY_STEP,
    Callers,
    ChunkRequest,
    CloseSession,
    Empty,
    InferenceStep,
    LineageRecord,
    PeerRecord,
    PublishedRequest,
    Role,
    SyncPlanRequest,
    VerifyStep,
    lineage_key,
    stage_key,
)
from decentrl.net.push_messages import PushStep, ResultRequest, ResumeRequest, RevealRequest
from decentrl.net.session import new_session
from decentrl.net.training_messages import (
    AuditLoad,
    CheckpointRequest,
    LogprobsChain,
    LogprobsForward,
    ShardRequest,
    StateRequest,
    TapeRequest,
    TrainBackward,
    TrainChain,
    TrainForward,
    TrainStep,
)
from decentrl.net.wire import TensorLimits, encode_struct
from tests.swarm.test_swarm import make_batch

COORDINATOR_ONLY = [
    (TRAIN_FORWARD, TrainForward(micro=0, version=0, last=True, total_sequences=1,
                                 total_tokens=1)),
    (TRAIN_BACKWARD, TrainBackward(micro=0)),
    (TRAIN_STEP, TrainStep(grad_scale=1.0, version=1)),
    (TRAIN_DISCARD, Empty()),
    (CHECKPOINT, CheckpointRequest(action="load", version=0)),
    (TRAIN_PUBLISHED, PublishedRequest(version=0)),
    (TRAIN_STATE, StateRequest(version=0, offset=0, count=0)),
]


# Who may call each RPC, written out: turning an RPC from coordinator-only into "any peer" (or a
# new RPC nobody thought about) must fail a test, not pass all of them.
CALLERS: dict[str, Callers] = {
    "inference_step": "coordinator", "close_session": "coordinator",
    "verify_step": "coordinator", "train_forward": "coordinator",
    "train_backward": "coordinator", "train_grad_norm": "coordinator",
    "train_step": "coordinator", "train_discard": "coordinator", "checkpoint": "coordinator",
    "checkpoint_shard": "coordinator", "train_published": "coordinator",
    "train_state": "coordinator", "train_audit_load": "coordinator",
    "sync_plan": "same stage", "sync_chunk": "same stage",
    "submit_rollouts": "any peer", "dial_back": "any peer",
    "inference_push": "previous stage", "inference_result": "coordinator",
    "inference_resume": "coordinator", "reveal": "coordinator", "evidence": "coordinator",
    "train_chain": "previous stage", "train_tape": "coordinator",
    "train_logprobs": "coordinator", "train_logprobs_chain": "previous stage",
}


def test_every_rpc_has_the_callers_it_is_written_down_with() -> None:
    assert {method: rpc.callers for method, rpc in RPCS.items()} == CALLERS


# A stranger's request for every RPC that is not open to any peer, and the role of the peer that
# serves it. The test below is parametrised over RPCS: an RPC added without a case here fails.
STRANGER_CALLS: dict[str, tuple[Role, object]] = {
    "inference_step": ("inference", InferenceStep(session="s", start=0, batch=1, max_length=8)),
    "close_session": ("inference", CloseSession(session="s")),
    "verify_step": ("inference", VerifyStep(session="s", start=0, batch=1, max_length=8,
                                            version=0, prompt_columns=1)),
    "train_forward": ("training", COORDINATOR_ONLY[0][1]),
    "train_backward": ("training", TrainBackward(micro=0)),
    "train_grad_norm": ("training", Empty()),
    "train_step": ("training", TrainStep(grad_scale=1.0, version=1)),
    "train_discard": ("training", Empty()),
    "checkpoint": ("training", CheckpointRequest(action="load", version=0)),
    "checkpoint_shard": ("training", ShardRequest(version=0, offset=0, count=16)),
    "train_published": ("training", PublishedRequest(version=0)),
    "train_state": ("training", StateRequest(version=0, offset=0, count=0)),
    "train_audit_load": ("training", AuditLoad(version=0, step=0, offset=0, total=0, digest="",
                                               names=(), sizes=())),
    "sync_plan": ("training", SyncPlanRequest(stage=0, version=0, state_hash="")),
    "sync_chunk": ("inference", ChunkRequest(stage=0, kind="keyframe", version=0, index=0,
                                             wait_s=0.0)),
    "inference_push": ("inference", PushStep(route=b"", start=0, session="s")),
    "inference_result": ("inference", ResultRequest(id="s", start=0)),
    "inference_resume": ("inference", ResumeRequest(route=b"", start=0)),
    "reveal": ("inference", RevealRequest(id="s", first_row=0, rows=1, steps=[(0, 0, 1)])),
    "evidence": ("inference", EvidenceRequest(sender="s", method="inference_push")),
    "train_chain": ("training", TrainChain(route=b"", forward=COORDINATOR_ONLY[0][1])),
    "train_tape": ("training", TapeRequest(version=0, micro=0)),
    "train_logprobs": ("training", LogprobsForward(micro=0, version=0, last=True)),
    "train_logprobs_chain": ("training", LogprobsChain(
        route=b"", forward=LogprobsForward(micro=0, version=0, last=True))),
}
# What each rule answers a stranger (net/authority.py), and whether the refusal is a strike: an
# unknown caller of a "same stage" RPC may be a replica whose announcement has not spread yet.
REFUSALS: dict[Callers, tuple[str, int]] = {
    "coordinator": ("{method} is for the run's coordinator \\({owner}\\) only, not for "
                    "{stranger}", 1),
    "same stage": ("{method} is for the coordinator and the peers announced in stage 0; "
                   "{stranger} is not announced there", 0),
    # Stage 0 takes pushes from the coordinator only (the swarm here has one stage).
    "previous stage": ("{method} is for the run's coordinator \\({owner}\\) only, not for "
                       "{stranger}", 1),
}


@pytest.fixture(scope="module")
def shared_swarm_and_stranger(tiny_sharp_dir: Path) -> Iterator[tuple[Swarm, SwarmNode]]:
    """`swarm_and_stranger` once for the module: the stranger cases only read the peers."""
    yield from swarm_with_stranger(tiny_run_config(tiny_sharp_dir, 1))


@pytest.mark.network
@pytest.mark.parametrize("method", [method for method, rpc in RPCS.items()
                                    if rpc.callers != "any peer"])
def test_a_stranger_calling_any_guarded_rpc_is_refused(
        method: str, shared_swarm_and_stranger: tuple[Swarm, SwarmNode]) -> None:
    assert method in STRANGER_CALLS, f"{method} has no stranger case in STRANGER_CALLS"
    swarm, stranger = shared_swarm_and_stranger
    rpc = RPCS[method]
    role, body = STRANGER_CALLS[method]
    target = swarm.peer(0, role)
    trainer_peer = swarm.peer(0, "training")
    assert trainer_peer.training is not None
    norm_before, _ = swarm.client.call_sync(trainer_peer.node.peer_id, TRAIN_GRAD_NORM, Empty(),
                                            timeout=20)
    strikes = target.node.strikes(stranger.peer_id)
    refusal, strike = REFUSALS[rpc.callers]
    with pytest.raises(PeerRefused, match=refusal.format(
            method=method, owner=swarm.client.peer_id[-8:], stranger=stranger.peer_id[-8:])):
        stranger.call_sync(target.node.peer_id, rpc, body, timeout=20)
    # A caller is refused before its request is read, so a refusal whose frame the stream lost
    # (about once in a thousand streams under load) is asked again and struck again.
    struck = target.node.strikes(stranger.peer_id) - strikes
    assert strike <= struck <= strike * (1 + TRUNCATED_REPLY_RETRIES), (struck, strike)
    assert target.node.strikes(swarm.client.peer_id) == 0
    # Nothing moved, and the coordinator is still served.
    assert target.version == 0 and trainer_peer.version == 0
    assert not trainer_peer.training.trainer.saved
    assert swarm.peer(0, "inference").inference is not None
    assert not swarm.peer(0, "inference").inference.sessions  # type: ignore[union-attr]
    norm_after, _ = swarm.client.call_sync(trainer_peer.node.peer_id, TRAIN_GRAD_NORM, Empty(),
                                           timeout=20)
    assert norm_after == norm_before


@pytest.fixture
def swarm_and_stranger(tiny_sharp_dir: Path) -> Iterator[tuple[Swarm, SwarmNode]]:
    yield from swarm_with_stranger(tiny_run_config(
        tiny_sharp_dir, 1, train={"lr": 0.05}, sync={"density": 0.5, "chunk_wait_s": 1.0}))


def swarm_with_stranger(config: RunConfig) -> Iterator[tuple[Swarm, SwarmNode]]:
    """A training peer and a replica of stage 0, and a stranger's node beside them."""
    with start_swarm(config, [(0, "training"), (0, "inference")]) as swarm:
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        try:
            yield swarm, stranger
        finally:
            stranger.shutdown()


def grads_of(swarm: Swarm) -> dict[str, torch.Tensor]:
    training = swarm.peer(0, "training").training
    assert training is not None
    return {name: param.grad.clone() for name, param in training.model.named_parameters()
            if param.grad is not None}


@pytest.mark.network
def test_a_stranger_cannot_steer_fail_or_roll_back_a_training_step(
        swarm_and_stranger: tuple[Swarm, SwarmNode]) -> None:
    swarm, stranger = swarm_and_stranger
    trainer_peer = swarm.peer(0, "training")
    assert trainer_peer.training is not None
    (worker,) = swarm.workers()
    batch = make_batch()
    # The coordinator's forward and backward of a micro-batch: the stranger strikes between the
    # backward and the step, where a forged gradient or a discard would steer or fail it.
    inputs: Activations = (batch.prompts, batch.completions)
    rows, tokens = batch.completions.shape[0], int(batch.completion_generated.sum())
    worker.forward(0, inputs, batch, LossInputs(None, None, rows, tokens))
    worker.backward(0, None)
    grads = grads_of(swarm)
    saved = set(trainer_peer.training.trainer.saved)
    assert grads
    for rpc, body in COORDINATOR_ONLY:
        with pytest.raises(PeerRefused, match=f"{rpc.method} is for the run's coordinator "
                                              f"\\({swarm.client.peer_id[-8:]}\\) only, not for "
                                              f"{stranger.peer_id[-8:]}"):
            stranger.call_sync(trainer_peer.node.peer_id, rpc, body, timeout=20)
    # Nothing changed: the gradients, the saved micro-batches, the version.
    after = grads_of(swarm)
    assert after.keys() == grads.keys()
    assert all(torch.equal(after[name], grads[name]) for name in grads)
    assert set(trainer_peer.training.trainer.saved) == saved
    assert trainer_peer.version == 0
    # Each refusal is a strike against the stranger, none against the coordinator.
    assert trainer_peer.node.strikes(stranger.peer_id) == len(COORDINATOR_ONLY)
    assert trainer_peer.node.strikes(swarm.client.peer_id) == 0
    # Training goes on: the coordinator's step lands, and its replicas take the version.
    worker.step(1.0)
    assert trainer_peer.version == 1 and worker.version == 1
    assert swarm.lineage is not None
    swarm.lineage.wait()
    replica = swarm.peer(0, "inference")
    assert replica.node.run(weights_of(replica).follow(), timeout=60) is True
    assert replica.version == 1


@pytest.mark.network
def test_a_stranger_cannot_drive_sessions_or_spot_checks_on_a_replica(
        swarm_and_stranger: tuple[Swarm, SwarmNode]) -> None:
    swarm, stranger = swarm_and_stranger
    replica = swarm.peer(0, "inference")
    step = InferenceStep(session="s", start=0, batch=1, max_length=8)
    verify = VerifyStep(session="s", start=0, batch=1, max_length=8, version=0,
                        prompt_columns=1)
    for rpc, body in ((INFERENCE_STEP, step), (CLOSE_SESSION, CloseSession(session="s")),
                      (VERIFY_STEP, verify)):
        with pytest.raises(PeerRefused, match=f"{rpc.method} is for the run's coordinator"):
            stranger.call_sync(replica.node.peer_id, rpc, body, timeout=20)
    assert replica.inference is not None and not replica.inference.sessions
    assert replica.node.strikes(stranger.peer_id) == 3


@pytest.mark.network
def test_weight_updates_go_only_to_the_coordinator_and_the_stages_announced_peers(
        swarm_and_stranger: tuple[Swarm, SwarmNode]) -> None:
    swarm, stranger = swarm_and_stranger
    trainer_peer = swarm.peer(0, "training")
    plan = SyncPlanRequest(stage=0, version=0, state_hash="")
    with pytest.raises(PeerRefused, match=f"sync_plan is for the coordinator and the peers "
                                          f"announced in stage 0; {stranger.peer_id[-8:]} is "
                                          "not announced there"):
        stranger.call_sync(trainer_peer.node.peer_id, SYNC_PLAN, plan, timeout=20)
    # Not a strike: it may be a replica whose announcement has not spread yet.
    assert trainer_peer.node.strikes(stranger.peer_id) == 0
    # Anyone may join a stage as an inference replica: once announced there, it is served.
    record = PeerRecord(name="volunteer", stage=0, layers=(0, 4), role="inference", version=0,
                        tokens_per_s=0.0, free_sessions=1, training_ready=False)
    assert stranger.run(stranger.announce(stage_key(swarm.config.name, 0), encode_struct(record),
                                          60), timeout=30)
    reply, _ = stranger.call_sync(trainer_peer.node.peer_id, SYNC_PLAN, plan, timeout=20)
    assert reply.version == 0


@pytest.mark.network
def test_a_stranger_announcing_a_newer_training_peer_or_lineage_moves_nothing(
        swarm_and_stranger: tuple[Swarm, SwarmNode]) -> None:
    swarm, stranger = swarm_and_stranger
    run = swarm.config.name
    trainer_peer, replica = swarm.peer(0, "training"), swarm.peer(0, "inference")
    # A stranger says it is a ready training peer far ahead, and publishes its own lineage.
    fake = PeerRecord(name="trainer", stage=0, layers=(0, 4), role="training", version=99,
                      tokens_per_s=0.0, free_sessions=0, training_ready=True)
    lineage = LineageRecord(stage=0, publisher=stranger.peer_id, hashes={99: "0" * 64},
                            session=new_session())
    assert stranger.run(stranger.announce(stage_key(run, 0), encode_struct(fake), 60),
                        timeout=30)
    # The lineage key is the owner's alone: no peer of the run keeps the stranger's.
    assert not stranger.run(stranger.announce(lineage_key(run, 0), encode_struct(lineage), 60),
                            timeout=30)
    directory = swarm.directory()
    assert stranger.peer_id in directory.records()  # it is in the directory...
    found = directory.training_peer(0, swarm.admitted)
    assert found is not None and found[0] == trainer_peer.node.peer_id  # ...and never chosen
    (worker,) = swarm.workers()
    assert worker.peer == trainer_peer.node.peer_id and worker.version == 0
    # The replica follows the owner's lineage only: nothing to take from the stranger's.
    assert replica.node.run(weights_of(replica).follow(), timeout=60) is False
    assert replica.version == 0


def test_the_operator_admits_training_peers_by_peer_id(tmp_path: Path) -> None:
    peer = "12D3KooWJGBqqn7rRqELaz3AxHTAUHtWH1Dj2L9H5nryw5SeGVx6"
    assert admitted_peers(tmp_path) == frozenset()
    admit(tmp_path, [peer, peer])
    assert (tmp_path / "admitted.txt").read_text() == f"{peer}\n"
    with (tmp_path / "admitted.txt").open("a") as file:
        file.write("# a comment\n\n")
    assert admitted_peers(tmp_path) == {peer}
    with pytest.raises(ValueError, match="--admit: 'stranger' is not a peer id"):
        admit(tmp_path, ["stranger"])
    with (tmp_path / "admitted.txt").open("a") as file:
        file.write("12D3KooWnotapeer\n")
    with pytest.raises(ValueError, match=r"admitted.txt line 4: '12D3KooWnotapeer' is not a "
                                         "peer id"):
        admitted_peers(tmp_path)


def test_a_peer_joins_only_with_the_config_and_model_its_owner_declares(
        tiny_sharp_dir: Path, tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_sharp_dir, 1)
    manifest = run_manifest(config, roster=[], session=new_session())
    # A peer without --config takes the run's settings, and keeps its own host's.
    assert accept_manifest(manifest, None) == config.with_host(HostConfig())
    assert accept_manifest(manifest, config) == config
    other = config.model_copy(update={"seed": config.seed + 1})
    with pytest.raises(ManifestMismatch, match="this peer's config differs from the one the "
                                               "owner of run"):
        accept_manifest(manifest, other)
    # The owner declared another model's weights (same config) than the copy this peer holds:
    # refused once the peer knows its stage, before it loads any of them.
    other_weights = msgspec.structs.replace(manifest, model_files=run_manifest(
        tiny_run_config(tiny_model_dir, 1), [], new_session()).model_files)
    assert accept_manifest(other_weights, config) == config
    with pytest.raises(ManifestMismatch, match="this peer's copy of the model differs from the "
                                               "owner's in model.safetensors"):
        check_stage_files(other_weights, config, 0)
    # A manifest whose config does not hash to what it declares is refused whole.
    tampered = json.loads(manifest.config_json)
    tampered["seed"] += 1
    with pytest.raises(ManifestMismatch, match="its config does not hash to the hash it "
                                               "declares"):
        accept_manifest(manifest.__class__(**{
            **{f: getattr(manifest, f) for f in manifest.__struct_fields__},
            "config_json": json.dumps(tampered)}), None)


def test_a_peer_hashes_only_the_shards_of_its_stage_and_is_refused_for_one_that_differs(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """The owner declares each file of a sharded model; a peer checks the config, the index and
    the shards its own stage reads: a changed shard of stage 0's layers refuses stage 0 by the
    file's name, and stage 1 (which never reads it) joins."""
    folder = shutil.copytree(tiny_sharp_dir, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    shard_of = {name: f"layer-{name.split('.')[2]}.safetensors" if ".layers." in name
                else "rest.safetensors" for name in tensors}
    for shard in set(shard_of.values()):
        save_file({n: t for n, t in tensors.items() if shard_of[n] == shard}, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shard_of}))
    config = tiny_run_config(folder, 2)
    manifest = run_manifest(config, roster=[], session=new_session())
    assert set(manifest.model_files) == {"config.json", "model.safetensors.index.json",
                                         *shard_of.values()}
    # A model in more files than one signed record declares is refused at the owner.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest_module, "MAX_MODEL_FILES", len(manifest.model_files) - 1)
        with pytest.raises(ValueError, match="more than a run's manifest declares"):
            run_manifest(config, roster=[], session=new_session())
    hashed: list[set[str]] = []
    real_hash = manifest_module.file_hashes

    def recording(paths: list[Path]) -> dict[str, str]:
        hashed.append({path.name for path in paths})
        return real_hash(paths)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest_module, "file_hashes", recording)
        for stage in (0, 1):
            check_stage_files(manifest, config, stage)
    known = {"config.json", "model.safetensors.index.json", "rest.safetensors"}
    assert hashed == [known | {"layer-0.safetensors", "layer-1.safetensors"},
                      known | {"layer-2.safetensors", "layer-3.safetensors"}]
    # A shard of stage 0's layers differs here.
    changed = load_file(folder / "layer-0.safetensors")
    save_file({name: tensor + 1 for name, tensor in changed.items()},
              folder / "layer-0.safetensors")
    assert accept_manifest(manifest, config) == config  # the config and the index are the same
    with pytest.raises(ManifestMismatch, match="differs from the owner's in layer-0.safetensors"):
        check_stage_files(manifest, config, 0)
    check_stage_files(manifest, config, 1)  # it never reads that shard
    # An owner whose copy is one file declares no index: this peer's sharded copy is another.
    unsharded = {name: hash for name, hash in manifest.model_files.items()
                 if name != "model.safetensors.index.json"}
    with pytest.raises(ManifestMismatch, match="has model.safetensors.index.json, which the "
                                               "owner's does not"):
        accept_manifest(msgspec.structs.replace(manifest, model_files=unsharded), config)


def test_peers_on_different_hardware_join_one_run_whose_settings_they_share(
        tiny_sharp_dir: Path) -> None:
    """A GPU-like peer (bf16, 8 threads, its own folders and links) and a CPU peer (fp32, one
    thread) are accepted by the owner's manifest, which carries no host section; a peer whose
    run settings differ in one field is refused."""
    owner = tiny_run_config(tiny_sharp_dir, 1)
    manifest = run_manifest(owner, roster=[], session=new_session())
    assert "host" not in json.loads(manifest.config_json)
    gpu_like = owner.with_host(HostConfig(
        device="auto", dtype="bf16", threads=8, run_dir=Path("/data/runs"),
        checkpoint_dir=Path("/data/ckpt"), dashboard_port=None,
        link=LinkConfig(rtt_ms=(60.0, 120.0), jitter_ms=10.0)))
    cpu = owner.with_host(HostConfig(device="cpu", dtype="fp32", threads=1))
    for peer in (gpu_like, cpu):
        assert config_hash(peer) == manifest.config_hash
        assert accept_manifest(manifest, peer) == peer  # its own host settings kept
        assert accept_manifest(manifest, None).with_host(peer.host) == peer
    other_run = owner.model_copy(update={"train": owner.train.model_copy(update={"lr": 2e-2})})
    with pytest.raises(ManifestMismatch, match="this peer's config differs"):
        accept_manifest(manifest, other_run.with_host(gpu_like.host))

