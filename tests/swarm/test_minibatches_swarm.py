"""Several optimizer steps per batch in the swarm (train.minibatches_per_batch x epochs_per_batch,
issue #38): the coordinator's loop over in-process peers moves every stage that many versions a
step, scores every update against proximal log-probs a forward-only pass fixed before the first,
signs every version into the lineage, and its replicas follow; an audit checks each update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from swarm_helpers import publisher_of, start_swarm, tiny_run_config, weights_of

from decentrl.coordinator.manifest import admit
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.observe.metrics import read_metrics
from tests.swarm.test_operator_view import DigitsTask
from tests.swarm.test_swarm import make_batch
from tests.swarm.test_train_audit import admit_auditors, audited_trainer

pytestmark = pytest.mark.network

UPDATES = {"minibatches_per_batch": 2, "epochs_per_batch": 2}
# Entropy control (learn/entropy.py) rides along peer to peer: KL-Cov's selected tokens and the
# adaptive bonus's weight reach the last stage with every micro-batch (and its audit's replay).
ENTROPY = {"method": "kl_cov", "fraction": 0.25, "target": 10.0, "coef_step": 0.01}


@pytest.mark.parametrize("plane", ["peer_to_peer", "coordinator"])
def test_each_step_is_four_versions_and_replicas_follow(plane: str, tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    steps = 2 if plane == "peer_to_peer" else 1  # relayed: the smaller check
    config = tiny_run_config(
        tiny_model_dir, 2, host={"run_dir": str(tmp_path), "dashboard_port": None},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        # Staleness counts versions: 4 a step, so two steps' worth of rollouts stay trainable.
        train={"steps": steps, "checkpoint_every": 1, "zero_variance_groups": "keep",
               "micro_batch_size": 2, "lr": 0.05, "max_staleness": 8, **UPDATES,
               "entropy": ENTROPY if plane == "peer_to_peer" else {}},
        trust={"history_versions": 8},
        eval={"problems": 2, "pass_k": 1, "max_new_tokens": 4, "batch_size": 2},
        swarm={"sessions_in_flight": 1, "announce_every_s": 0.5, "data_plane": plane})
    layout = [(0, "inference"), (0, "training"), (1, "inference"), (1, "training")]
    with start_swarm(config, layout) as swarm:
        trainers = [swarm.peer(stage, "training") for stage in range(2)]
        admit(config.path, [p.node.peer_id for p in trainers])  # makes the run folder
        # The coordinator moves the `latest` pointer where its training peers write checkpoints.
        (config.path / "checkpoints").symlink_to(swarm.checkpoint_dir)
        loop = swarm_run(config, swarm.client, Console(quiet=True))
        loop.ingestion.task = DigitsTask()  # rewards that vary within a group: weights move
        try:
            summary = loop.run(wait_s=60)
            assert summary.steps == steps and summary.recoveries == 0
            assert loop.trainer.version == 4 * steps
            assert [p.version for p in trainers] == [4 * steps] * 2
            records = read_metrics(config.path / "metrics.jsonl").steps
            assert [(r.step, r.version) for r in records] == [(s, 4 * s)
                                                             for s in range(1, steps + 1)]
            # Every update after a batch's first was scored against the proximal policy, which
            # the learner had left: the mean ratio of the step's updates moved off 1.
            assert all(r.ratio_mean is not None for r in records)
            if plane == "peer_to_peer":
                assert all((r.cov_selected_fraction or 0) > 0 for r in records)
                # The bonus applies from the second update on (entropy far below 10 nats).
                assert all((r.entropy_coef or 0) > 0 for r in records)
            assert any(abs(r.ratio_mean - 1) > 1e-3 or (r.clip_fraction or 0) > 0
                       for r in records), [(r.ratio_mean, r.clip_fraction) for r in records]
            # Every version was signed into its stage's lineage (each update's delta is one a
            # replica steps through), and the replicas reach the last one.
            lineage = loop.backend.lineage
            lineage.wait()
            for stage, trainer in enumerate(trainers):
                assert set(range(4 * steps + 1)) <= set(lineage.records[stage].hashes)
                publisher_of(trainer).wait(timeout=30)
                replica = swarm.peer(stage, "inference")
                replica.node.run(weights_of(replica).follow(), timeout=60)
                assert replica.version == 4 * steps
            # The checkpoints are at the versions the steps ended at, the bonus's coefficient
            # kept beside them.
            assert loop.store.last_checkpoint() == (4 * steps, steps)
            if plane == "peer_to_peer":
                meta = loop.backend.checkpoints.meta_file(4 * steps)
                assert loop.trainer.entropy_bonus is not None
                assert json.loads(meta.read_text())["entropy_coef"] == pytest.approx(
                    loop.trainer.entropy_bonus.coef)
        finally:
            loop.close()


def test_every_update_of_a_batch_is_audited(tiny_model_dir: Path) -> None:
    """Each update is a version the audited peer committed to, and its tape (kept by version
    and micro-batch, the entropy method's inputs with it) is revealed and replayed: four
    audits, every one passed."""
    config = tiny_run_config(tiny_model_dir, 1, train={**UPDATES, "entropy": ENTROPY},
                             trust={"train_audit_fraction": 1.0})
    with start_swarm(config, [(0, "training"), (0, "training")]) as swarm:
        primary = swarm.peers[0].node.peer_id
        allowed = {primary}
        trainer, audit, reputation = audited_trainer(swarm, allowed.__contains__)
        admit_auditors(trainer, allowed, [p.node.peer_id for p in swarm.peers])
        trainer.train_step(make_batch())
        assert trainer.version == 4
        assert audit.count["train_audits"] == 4 and audit.count["train_audit_liars"] == 0
        assert reputation.counts(primary).get("passed") == 4
