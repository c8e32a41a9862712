"""Audits of training peers (trust/audit.py, client/training.py TrainAudit): an honest AdamW
step passes the self-consistency check and a reversed one does not; over the network, honest
peers in fp32 and bf16 agree on every audited step; a peer that poisons its update is proved a
liar by its own committed states, banned, its step refused, and training goes on with another
peer (in the training loop too: the step is reverted and retried); a last-stage peer that forges
the trainer's row flags is outvoted by two replays, as is an auditor that lies; a bad request
for a state is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import build
from rich.console import Console
from swarm_helpers import Swarm, start_node, start_swarm, tiny_run_config

from decentrl.client.training import RemoteStageWorker, TrainAudit
from decentrl.client.training_push import PushedTraining
from decentrl.config import RunConfig, TrainConfig
from decentrl.coordinator.lineage import LineageSigner
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.manifest import admit
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.launch.adversary import hostile_peer
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.stage_trainer import StageTrainer
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel
from decentrl.net.directory import SwarmUnavailable
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, RemoteError
from decentrl.net.protocol import STATE_CHUNK_FLOATS, TRAIN_AUDIT_LOAD, TRAIN_STATE
from decentrl.net.session import new_session
from decentrl.net.training_messages import AuditLoad, StateRequest
from decentrl.net.wire import TensorLimits, WireError
from decentrl.rollout.sampling import SamplingConfig, sampling_config
from decentrl.stage.peer import StagePeer
from decentrl.trust.audit import (
    FlatState,
    check_step,
    flat_state,
    gradient_error,
    load_flat_state,
)
from decentrl.trust.reputation import Reputation
from tests.swarm.test_swarm import make_batch

CPU = torch.device("cpu")


# ---- the checks, on local stage trainers ---------------------------------------------------

def one_step(model: LoadedModel, train: TrainConfig, dtype: torch.dtype,
             start: StageTrainer | None = None) -> tuple[StageTrainer, FlatState, FlatState]:
    """A one-stage trainer (from `start`'s state if given), its state before and after one
    step."""
    pipeline = PipelineTrainer.local(build(model, 1), train, loss_config_from(train, 8),
                                     SamplingConfig(temperature=1.0), dtype)
    trainer = pipeline.stage_trainers[0]
    if start is not None:
        load_flat_state(trainer, flat_state(start))
    pre = flat_state(trainer)
    pipeline.train_step(make_batch())
    return trainer, pre, flat_state(trainer)


def test_an_honest_step_checks_out_and_a_reversed_one_does_not(tiny_model: LoadedModel) -> None:
    train = TrainConfig(lr=1e-2, micro_batch_size=2, weight_decay=0.01, lr_warmup_steps=3)
    trainer, pre, post = one_step(tiny_model, train, torch.float32)
    assert check_step(pre, post, train) is None
    _, pre2, post2 = one_step(tiny_model, train, torch.float32, start=trainer)  # Adam has history
    assert check_step(pre2, post2, train) is None
    reversed_weights = post2.flat.clone()
    for index in range(len(post2.sizes)):
        start = 3 * sum(post2.sizes[:index])
        size = post2.sizes[index]
        w0, w = pre2.flat[start:start + size], post2.flat[start:start + size]
        reversed_weights[start:start + size] = 2 * w0 - w
    poisoned = FlatState(post2.version, post2.step, post2.names, post2.sizes, reversed_weights)
    assert "AdamW" in str(check_step(pre2, poisoned, train))


def test_bf16_and_fp32_gradients_agree_within_the_default_tolerance(
        tiny_model: LoadedModel) -> None:
    train = TrainConfig(lr=1e-2, micro_batch_size=2)
    _, pre, post = one_step(tiny_model, train, torch.float32)
    _, _, bf16 = one_step(tiny_model, train, torch.bfloat16)
    error, _ = gradient_error(pre, post, bf16, train.betas[0])
    assert 0 < error < RunConfig().trust.train_audit_tolerance
    assert gradient_error(pre, post, post, train.betas[0])[0] == 0


# ---- over the network ----------------------------------------------------------------------

def add_hostile_trainer(swarm: Swarm, stage: int, adversary: str) -> StagePeer:
    node = start_node(swarm.config, adversary, swarm.client.addresses(), TensorLimits(),
                      LinkProfile())
    peer = hostile_peer(swarm.config, stage, node, swarm.client.peer_id, adversary, adversary,
                        role="training", checkpoint_dir=swarm.checkpoint_dir)
    peer.start()
    swarm.peers.append(peer)
    swarm.sockets.extend(node.socket_paths())
    return peer


def audited_trainer(swarm: Swarm, admitted: Callable[[str], bool]
                    ) -> tuple[PipelineTrainer, TrainAudit, Reputation]:
    """The coordinator's side: stage workers that audit every step."""
    config = swarm.config
    directory = swarm.directory()
    reputation = Reputation(config.trust.ban_score, config.trust.ban_s)
    directory.distrusted = reputation.banned
    if swarm.lineage is None:
        swarm.lineage = LineageSigner(swarm.client, config, new_session())
    audit = TrainAudit(swarm.client, directory, config, admitted, reputation)
    workers = [RemoteStageWorker(swarm.client, directory, stage, config.num_stages, config.swarm,
                                 admitted, swarm.lineage, audit)
               for stage in range(config.num_stages)]
    for worker in workers:
        worker.connect()
    # Peer to peer (the default), the audited step's tape comes from the peer's reveal.
    chain = PushedTraining(swarm.client, workers, config.swarm, config.name, "") \
        if config.swarm.data_plane == "peer_to_peer" else None
    trainer = PipelineTrainer(workers, config.train,
                              loss_config_from(config.train, config.rollout.max_new_tokens,
                                               config.trust),
                              sampling_config(config.rollout), CPU, chain=chain)
    return trainer, audit, reputation


def admit_auditors(trainer: PipelineTrainer, allowed: set[str], peers: list[str]) -> None:
    """Admit `peers` once the workers drive the peers admitted so far; those commit to their
    state now that their stage has auditors."""
    allowed.update(peers)
    for worker in trainer.workers:
        assert isinstance(worker, RemoteStageWorker)
        worker.commit()


@pytest.mark.network
def test_honest_peers_in_fp32_and_bf16_agree(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, trust={"train_audit_fraction": 1.0})
    bf16 = tiny_run_config(tiny_model_dir, 2, host={"dtype": "bf16"}, name=config.name,
                           trust={"train_audit_fraction": 1.0})
    with start_swarm(config, [(0, "training"), (1, "training")]) as swarm:
        primaries = {p.node.peer_id for p in swarm.peers}
        for stage in (0, 1):
            auditor = start_node(bf16, f"bf16-{stage}", swarm.client.addresses(),
                                 TensorLimits(), LinkProfile())
            peer = StagePeer(bf16, stage, "training", auditor, swarm.client.peer_id,
                             swarm.checkpoint_dir, f"bf16-{stage}")
            peer.start()
            swarm.peers.append(peer)
            swarm.sockets.extend(auditor.socket_paths())
        allowed = set(primaries)
        trainer, audit, reputation = audited_trainer(swarm, allowed.__contains__)
        # Without an auditor at its stage, a training peer keeps no copy of its state.
        assert all(p.training is not None and not p.training.states for p in swarm.peers)
        admit_auditors(trainer, allowed, [p.node.peer_id for p in swarm.peers])
        for seed in range(3):
            trainer.train_step(make_batch(seed))
        assert audit.count["train_audits"] == 6
        assert audit.count["train_audit_liars"] == 0
        assert trainer.version == 3
        assert all(reputation.counts(p.node.peer_id).get("passed") == 3 for p in swarm.peers)


@pytest.mark.network
def test_a_poisoned_update_is_caught_and_training_goes_on(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1, trust={"train_audit_fraction": 1.0})
    with start_swarm(config, [(0, "training"), (0, "training")]) as swarm:
        poisoner = add_hostile_trainer(swarm, 0, "poison-update")
        allowed = {poisoner.node.peer_id}
        trainer, audit, reputation = audited_trainer(swarm, allowed.__contains__)
        admit_auditors(trainer, allowed, [p.node.peer_id for p in swarm.peers])
        (worker,) = trainer.workers
        assert isinstance(worker, RemoteStageWorker) and worker.peer == poisoner.node.peer_id
        with pytest.raises(SwarmUnavailable, match="not an AdamW step"):
            trainer.train_step(make_batch())
        assert reputation.banned(poisoner.node.peer_id)
        assert audit.count["train_audit_liars"] == 1
        # The loop reconnects (coordinator/loop.py recovery): the liar is no longer driven, and the
        # stage goes on from the state before the poisoned step.
        assert worker.connect() == 0
        assert worker.peer != poisoner.node.peer_id
        trainer.train_step(make_batch(1))
        assert trainer.version == 1 and audit.count["train_audit_liars"] == 1


@pytest.mark.network
def test_forged_flags_are_outvoted(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1, trust={"train_audit_fraction": 1.0,
                                                        "flag_surprise": 3.0})
    with start_swarm(config, [(0, "training"), (0, "training")]) as swarm:
        honest = [p.node.peer_id for p in swarm.peers]
        forger = add_hostile_trainer(swarm, 0, "forge-flags")
        allowed = {forger.node.peer_id}
        trainer, audit, reputation = audited_trainer(swarm, allowed.__contains__)
        admit_auditors(trainer, allowed, honest)
        with pytest.raises(SwarmUnavailable, match="row statistics"):
            trainer.train_step(make_batch())
        assert reputation.banned(forger.node.peer_id)
        assert audit.count["train_audit_disagreements"] == 1
        assert all(reputation.counts(peer).get("passed") == 1 for peer in honest)


@pytest.mark.network
def test_bad_state_requests_are_refused_and_counted(tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1, trust={"train_audit_fraction": 1.0})
    with start_swarm(config, [(0, "training")]) as swarm:
        peer = swarm.peer(0)
        strikes: list[str] = []
        peer.node.on_strike = lambda sender, reason: strikes.append(reason)
        target = peer.node.peer_id
        header, _ = swarm.client.call_sync(target, TRAIN_STATE,
                                           StateRequest(version=0, offset=0, count=0))
        load = AuditLoad(version=0, step=0, offset=0, total=header.total, digest=header.digest,
                         names=header.names, sizes=header.sizes)
        refusals = [
            (TRAIN_STATE, StateRequest(version=0, offset=0, count=STATE_CHUNK_FLOATS + 1), {},
             "count must be in"),
            (TRAIN_STATE, StateRequest(version=0, offset=header.total + 1, count=1), {},
             "outside the state"),
            (TRAIN_AUDIT_LOAD, msgspec.structs.replace(load, sizes=(1,) * len(header.sizes)),
             {"data": torch.zeros(4)}, "not of stage 0's parameters"),
            (TRAIN_AUDIT_LOAD, msgspec.structs.replace(load, offset=4), {"data": torch.zeros(4)},
             "must be sent from offset 0"),
        ]
        for rpc, body, tensors, why in refusals:
            with pytest.raises((PeerRefused, WireError, RemoteError), match=why):
                swarm.client.call_sync(target, rpc, body, exact=tensors or None, timeout=20)
        assert len(strikes) == len(refusals)
        # A request far over the limit is refused from its header and left unread: the reset of
        # the stream can overtake the refusal written first (net/streams.py, discard_rest), so
        # the caller sees the refusal, a reset, or a broken pipe while it still writes; the
        # peer's strike names the size either way.
        with pytest.raises((PeerRefused, WireError, RemoteError),
                           match="request over|Connection reset|Broken pipe|closed"):
            swarm.client.call_sync(target, TRAIN_AUDIT_LOAD, load,
                                   exact={"data": torch.zeros(2 * STATE_CHUNK_FLOATS)}, timeout=20)
        assert len(strikes) == len(refusals) + 1 and "request over" in strikes[-1], strikes
        # Nothing was loaded: the peer has no audit state to step.
        assert peer.training is not None and peer.training.audit_trainer is None


@pytest.mark.network
def test_a_lying_auditor_is_outvoted_and_the_step_stands(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_run_config(tiny_model_dir, 1, trust={"train_audit_fraction": 1.0,
                                                        "flag_surprise": 3.0})
    with start_swarm(config, [(0, "training"), (0, "training")]) as swarm:
        primary, third = (p.node.peer_id for p in swarm.peers)
        forger = add_hostile_trainer(swarm, 0, "forge-flags").node.peer_id
        allowed = {primary}
        trainer, audit, reputation = audited_trainer(swarm, allowed.__contains__)
        admit_auditors(trainer, allowed, [forger, third])
        monkeypatch.setattr(audit, "_others", lambda stage, exclude: [forger, third])
        trainer.train_step(make_batch())
        assert trainer.version == 1
        assert reputation.banned(forger) and not reputation.banned(primary)
        assert reputation.counts(primary).get("passed") == 1
        assert reputation.counts(third).get("passed") == 1


class AdmitTheOthers(RunHooks):
    """Once the coordinator drives the poisoner, the honest training peers are admitted too."""

    def __init__(self, run_path: Path, peers: list[str]) -> None:
        self.run_path, self.peers = run_path, peers

    def training_started(self, loop: TrainingLoop) -> None:
        admit(self.run_path, self.peers)


@pytest.mark.network
def test_the_loop_reverts_a_poisoned_step_and_trains_on(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_model_dir, 1, host={"run_dir": str(tmp_path), "dashboard_port": None},
        trust={"train_audit_fraction": 1.0},
        rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"steps": 2, "checkpoint_every": 1, "zero_variance_groups": "keep"},
        eval={"problems": 2, "pass_k": 1, "max_new_tokens": 4, "batch_size": 2},
        swarm={"sessions_in_flight": 1, "announce_every_s": 0.5})
    with start_swarm(config, [(0, "inference"), (0, "training"), (0, "training")]) as swarm:
        honest = [p.node.peer_id for p in swarm.peers if p.training is not None]
        poisoner = add_hostile_trainer(swarm, 0, "poison-update")
        admit(config.path, [poisoner.node.peer_id])
        # The coordinator moves the `latest` pointer where its training peers write checkpoints.
        (config.path / "checkpoints").symlink_to(swarm.checkpoint_dir)
        loop = swarm_run(config, swarm.client, Console(quiet=True),
                         hooks=[AdmitTheOthers(config.path, honest)])
        try:
            summary = loop.run(wait_s=60)
        finally:
            loop.close()
        # The poisoned step was not recorded: the loop brought the stage back to the store's
        # version (the new training peer's, so nothing to load) and trained its groups again.
        assert summary.trust["train_audit_liars"] == 1
        assert list(summary.banned) == [poisoner.node.peer_id]
        assert summary.steps == 2 and loop.trainer.version == 2
        (worker,) = loop.trainer.workers
        assert isinstance(worker, RemoteStageWorker) and worker.peer in honest
