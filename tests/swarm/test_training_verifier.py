"""A stage with a single replica is still judged: its training peer keeps a copy of what the
replicas serve (stage/replica.py `ServedWeights`, written by its publisher at every published
state) and re-executes spot-checks on it (stage/verification.py), at the versions a group
recorded. Every swarm here has one inference replica per stage beside each stage's training
peer, so the training peer is the only one who can judge a replica's work.

- A group generated three versions ago passes on the training peers, every stage checked, and
  their copies come back to the newest version bit for bit; only the owner may drive a check.
- A coordinated run checks every group: every stage is judged, nobody is charged.
- A lying single replica (random tokens at the last stage, corrupt activations at the first) is
  caught and blamed by its stage's training peer.
- The switch (trust.training_peer_verifies) off: no announcement, no verify_step served.
- `Directory.verifiers` lists replicas and verifying training peers, and nobody ineligible.
- Without the network: the copy a publisher keeps from its own updates is a replica's weights
  bit for bit (bf16) at every version it can rewind to, and after a rollback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from msgspec.structs import replace
from swarm_helpers import (
    Swarm,
    publisher_of,
    serving,
    start_node,
    start_swarm,
    tiny_run_config,
    weights_of,
)

from decentrl.config import RunConfig
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.loading import LoadedModel
from decentrl.model.stages import StageModule, StagePlan, build_stage
from decentrl.net.directory import Directory, PeerState
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, SwarmNode
from decentrl.net.protocol import CLOSE_SESSION, VERIFY_STEP, CloseSession, VerifyStep
from decentrl.net.wire import TensorLimits
from decentrl.stage.peer import StagePeer
from decentrl.stage.replica import ServedWeights, published_tensors
from decentrl.sync.delta import (
    PublishedState,
    apply_payload,
    decode_payload,
    encode_delta,
    payload_bytes,
)
from decentrl.sync.history import VersionUnavailable
from decentrl.trust.verify import Verifier
from tests.swarm.test_adversaries import add_replica, coordinated, generation, trust_config
from tests.swarm.test_swarm import make_batch
from tests.unit.trust.test_trust_claims import replica_record

LAYOUT = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference")]


def config_for(model_dir: Path, **trust: Any) -> RunConfig:
    return tiny_run_config(model_dir, 2, rollout={"group_size": 4, "max_new_tokens": 6,
                                                  "temperature": 0.9},
                           train={"micro_batch_size": 8, "max_staleness": 4, "lr": 1e-2},
                           trust={"history_versions": 4, **trust})


def served_copy(peer: StagePeer) -> dict[str, torch.Tensor]:
    """A training peer's copy of what its replicas serve, as it is now."""
    assert peer.verification is not None, f"{peer.name} does not verify"
    return {name: tensor.clone()
            for name, tensor in peer.verification.weights.model.state_dict().items()}


def wait_for_version(peer: StagePeer, version: int) -> None:
    """Until a replica's follow loop has brought it to `version`."""
    deadline = time.monotonic() + 60
    while peer.version != version and time.monotonic() < deadline:
        time.sleep(0.2)
    assert peer.version == version, f"{peer.name} is at v{peer.version}"


def verifier_for(swarm: Swarm, config: RunConfig, model: Any, directory: Directory) -> Verifier:
    directory.refresh()
    return Verifier(swarm.client, directory, config, model.spec.hidden_size,
                    model.tokenizer.pad_token_id)


@pytest.mark.slow  # half a minute of daemons: make test-slow (CI runs it)
@pytest.mark.network
def test_a_single_replicas_group_from_older_versions_is_judged_by_the_training_peers(
        tiny_sharp_dir: Path) -> None:
    config = config_for(tiny_sharp_dir)
    with start_swarm(config, LAYOUT) as swarm:
        model, chain, worker, scheduler = generation(swarm, config, tiny_sharp_dir)
        sessions: list[Any] = []
        [group] = worker.generate_groups(scheduler.next(1), on_session=sessions.append)
        provenance = sessions[0].provenance
        assert group.stage_versions == [0, 0]
        trainer = swarm.remote_trainer()
        for seed in range(3):
            trainer.train_step(make_batch(seed))
        trainers = [swarm.peer(stage, "training") for stage in (0, 1)]
        replicas = [swarm.peer(stage, "inference") for stage in (0, 1)]
        copies = []
        for peer, replica in zip(trainers, replicas, strict=True):
            wait_for_version(replica, 3)
            publisher_of(peer).wait(30)
            copies.append(served_copy(peer))
            # What the training peer keeps is exactly what its replica serves at v3.
            for name, tensor in serving(replica).model.state_dict().items():
                assert torch.equal(copies[-1][name], tensor), name
        records = swarm.directory().records()
        assert [records[p.node.peer_id].verifies for p in trainers] == [True, True]
        assert not any(records[p.node.peer_id].verifies for p in replicas)

        verifier = verifier_for(swarm, config, model, chain.directory)
        panel = verifier.panel(provenance)
        # Each stage's only replica produced the group: its training peer is the one judge left.
        assert panel == tuple(p.node.peer_id for p in trainers)
        verdict = verifier.verify(group, provenance, panel)
        assert verdict.outcome == "passed", verdict
        assert verdict.checked == (0, 1)
        for peer, before in zip(trainers, copies, strict=True):
            assert peer.verification is not None and peer.verification.busy_s > 0
            assert not peer.verification.sessions.sessions  # the verifier closed its session
            # Rewound to v0 for the check, and back to v3 exactly.
            assert peer.verification.weights.model.version == 3
            for name, tensor in served_copy(peer).items():
                assert torch.equal(tensor, before[name]), name

        # Only the run's owner may drive a check there, as on a replica (net/authority.py).
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        try:
            verify = VerifyStep(session="s", start=0, batch=1, max_length=8, version=0,
                                prompt_columns=1)
            for rpc, body in ((VERIFY_STEP, verify), (CLOSE_SESSION, CloseSession(session="s"))):
                with pytest.raises(PeerRefused, match=f"{rpc.method} is for the run's coord"):
                    stranger.call_sync(trainers[0].node.peer_id, rpc, body, timeout=20)
        finally:
            stranger.shutdown()


@pytest.mark.network
def test_a_run_with_one_replica_per_stage_judges_every_stage_and_bans_nobody(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """The coordinator's own spot-checks (every group) over one replica per stage: the training
    peers judge, the replicas earn passes at their stage, and nobody is charged."""
    config = trust_config(tiny_sharp_dir, steps=3, host={"run_dir": str(tmp_path / "runs")})
    with start_swarm(config, LAYOUT) as swarm, coordinated(config, swarm) as coordinator:
        summary = coordinator.run(wait_s=60)
        trust = coordinator.backend.trust
        assert summary.steps == config.train.steps
        assert trust.count["verified"] > 0, trust.count
        for stage in (0, 1):
            replica = swarm.peer(stage, "inference").node.peer_id
            judge = swarm.peer(stage, "training").node.peer_id
            assert trust.reputation.counts(replica).get("passed", 0) > 0
            assert trust.reputation.counts(judge).get("passed", 0) > 0  # upheld as a verifier
        for peer in swarm.peers:
            assert not trust.reputation.banned(peer.node.peer_id)
            assert trust.reputation.counts(peer.node.peer_id).get("failed", 0) == 0


@pytest.mark.network
@pytest.mark.parametrize(("kind", "stage"), [("random-tokens", 1), ("corrupt-activations", 0)])
def test_a_lying_single_replica_is_caught_by_its_stages_training_peer(
        kind: str, stage: int, tiny_sharp_dir: Path, tmp_path: Path) -> None:
    config = config_for(tiny_sharp_dir)
    honest = [(s, role) for s, role in LAYOUT if (s, role) != (stage, "inference")]
    with start_swarm(config, honest) as swarm:
        liar = add_replica(swarm, config, stage, f"hostile{stage}", kind, tmp_path)
        model, chain, worker, scheduler = generation(swarm, config, tiny_sharp_dir)
        sessions: list[Any] = []
        [group] = worker.generate_groups(scheduler.next(1), on_session=sessions.append)
        provenance = sessions[0].provenance
        assert provenance.stage_peers(stage) == {liar.node.peer_id}
        verifier = verifier_for(swarm, config, model, chain.directory)
        panel = verifier.panel(provenance)
        assert panel is not None and panel[stage] == swarm.peer(stage, "training").node.peer_id
        verdict = verifier.verify(group, provenance, panel)
        assert verdict.outcome == "failed", verdict
        assert (verdict.stage, verdict.peer) == (stage, liar.node.peer_id)
        assert stage in verdict.checked


@pytest.mark.network
def test_with_the_switch_off_a_training_peer_neither_announces_nor_serves_checks(
        tiny_model_dir: Path) -> None:
    config = config_for(tiny_model_dir, training_peer_verifies=False)
    with start_swarm(config, [(0, "training"), (1, "training")]) as swarm:
        for peer in swarm.peers:
            assert peer.verification is None and not peer.record().verifies
            assert all(rpc is not VERIFY_STEP for service in peer.services
                       for rpc, _ in service.handlers())
        directory = swarm.directory()
        assert directory.verifiers(0, set()) == directory.verifiers(1, set()) == []


@pytest.mark.network
def test_a_restarted_or_rolled_back_training_peer_publishes_what_its_replicas_served(
        tiny_sharp_dir: Path) -> None:
    """With sparse updates the learner's weights are not what the replicas serve. A training
    peer that comes back from a checkpoint (a crash) or rolls back to one publishes the state
    its replicas served at that version, the hash the lineage signed there, bit for bit: its
    copy judges the groups of that version as the replicas made them, and the replicas need no
    keyframe. (It once published the learner's weights under the old version number, and every
    later check of an honest replica at that version failed on the training peer's copy.)"""
    config = config_for(tiny_sharp_dir)
    assert config.sync.mode == "sparse"
    with start_swarm(config, [(0, "training"), (1, "training"), (0, "inference")]) as swarm:
        replica = swarm.peer(0, "inference")
        trainer = swarm.remote_trainer()
        worker = trainer.workers[0]
        assert swarm.lineage is not None  # made by the trainer's workers

        def follow() -> None:  # once the coordinator has signed (no wait for the next round)
            swarm.lineage.wait()
            replica.node.run(weights_of(replica).follow(), timeout=60)

        for seed in range(2):
            trainer.train_step(make_batch(seed))
        follow()
        assert replica.version == 2
        at_two = weights_of(replica).follower.state.hash
        for each in trainer.workers:
            each.checkpoint("save", 2)
        CheckpointLayout(swarm.checkpoint_dir).commit(2)
        trainer.train_step(make_batch(2))
        follow()
        assert replica.version == 3
        assert weights_of(replica).follower.state.hash != at_two

        assert worker.checkpoint("load", 2).version == 2  # a rollback
        first = swarm.peer(0, "training")
        assert publisher_of(first).published(2).result(timeout=30) == (at_two, None)
        follow()
        assert (replica.version, weights_of(replica).follower.state.hash) == (2, at_two)

        swarm.kill(first)  # a crash, and a replacement from the same checkpoint folder
        second = swarm.add(0, "training")
        assert worker.connect() == 2
        follow()
        assert (replica.version, weights_of(replica).follower.state.hash) == (2, at_two)
        assert publisher_of(second).published(2).result(timeout=30) == (at_two, None)
        learner = PublishedState.of(2, published_tensors(second.training.trainer.stage))
        assert learner.hash != at_two  # the sparse updates left some of the learner's change out
        for name, tensor in serving(replica).model.state_dict().items():
            assert torch.equal(served_copy(second)[name], tensor), name


def test_verifiers_are_the_stages_replicas_and_training_peers_that_verify() -> None:
    """`Directory.verifiers` lists every eligible peer, choosing none: replicas of the stage and
    its training peers that announce `verifies`, live, not banned, not distrusted, not
    excluded."""
    config = tiny_run_config(Path("."), 2)
    distrusted = {"liar"}
    directory = Directory(cast(SwarmNode, None), config.name, 2, config.swarm,
                          distrusted=distrusted.__contains__)
    trainer = replace(replica_record("trainer", 0), role="training", training_ready=True,
                      verifies=True)
    records = {"replica": replica_record("replica", 0), "other-stage": replica_record("x", 1),
               "trainer": trainer, "mute-trainer": replace(trainer, verifies=False),
               "both": replace(trainer, role="both"), "liar": replica_record("liar", 0),
               "banned": replica_record("banned", 0), "producer": replica_record("p", 0)}
    for peer, record in records.items():
        directory.peers[peer] = PeerState(record)
    directory.peers["banned"].banned_until = time.monotonic() + 60
    assert sorted(directory.verifiers(0, {"producer"})) == ["both", "replica", "trainer"]
    assert directory.verifiers(1, {"x"}) == ["other-stage"]


def test_a_publishers_served_copy_is_a_replicas_weights_bit_for_bit_at_every_version(
        tiny_model: LoadedModel) -> None:
    """In bf16 (the serving dtype on a GPU), with no network: the copy a publisher keeps from
    its own updates (`take`) and a replica that decodes the same updates (`commit`) hold the same
    bits at every version, rewound or not; a rollback (the state taken whole) is the cast of that
    state, and nothing before it can be rewound."""
    plan = StagePlan.even(tiny_model.spec.num_layers, 2)

    def stage() -> StageModule:
        return build_stage(tiny_model.spec, plan, 0, tiny_model.tensors, torch.device("cpu"),
                           torch.float32)

    learner = {name: t.clone() for name, t in stage().state_dict().items()}
    publisher = PublishedState.of(0, learner)
    published = PublishedState.of(0, learner)  # the replica's float32 copy
    copy = ServedWeights(stage().to(torch.bfloat16), keep=3)
    copy.take(publisher, None)
    replica = ServedWeights(stage().to(torch.bfloat16), keep=3)
    g = torch.Generator().manual_seed(0)
    served = {0: {n: t.clone() for n, t in replica.model.state_dict().items()}}
    for version in range(1, 5):
        for t in learner.values():
            t += 1e-2 * torch.randn(t.shape, generator=g)
        payload = encode_delta(publisher, learner, 0.05)
        copy.take(publisher, apply_payload(publisher, payload, version))
        shapes = {n: t.shape for n, t in published.tensors.items()}
        replica.commit(version, apply_payload(
            published, decode_payload(payload_bytes(payload), shapes), version))
        served[version] = {n: t.clone() for n, t in replica.model.state_dict().items()}
    assert copy.model.version == replica.model.version == 4
    for version in (4, 2, 1):
        with copy.rewound(version) as model:
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor.view(torch.int16),
                                   served[version][name].view(torch.int16)), (version, name)
    with pytest.raises(VersionUnavailable), copy.rewound(0):  # four updates ago, three kept
        pass
    assert copy.model.version == 4 and not copy.lock.locked()

    rollback = PublishedState.of(2, {n: t + 1 for n, t in learner.items()})
    copy.take(rollback, None)
    assert copy.model.version == 2
    for name, tensor in copy.model.state_dict().items():
        assert torch.equal(tensor, rollback.tensors[name].to(torch.bfloat16)), name
    with pytest.raises(VersionUnavailable), copy.rewound(1):
        pass
