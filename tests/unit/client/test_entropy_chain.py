"""Entropy control through the training peers (learn/entropy.py): the tokens Clip-Cov selected
over the whole batch and the adaptive bonus's weight reach the last stage, pushed down the chain
or relayed, and give the step the local trainer takes; a last stage refuses entropy inputs the
run does not have. In the protocols' local mode (net/local_node.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from swarm_helpers import local_trainer, start_swarm, tiny_run_config

from decentrl.learn.batch import TrainBatch
from decentrl.learn.stage_loss import LossInputs
from decentrl.model.loading import LoadedModel
from decentrl.net.directory import SwarmUnavailable
from tests.swarm.test_swarm import make_batch

ENTROPY = {"method": "clip_cov", "fraction": 0.3, "clip_cov_bounds": (-1e9, 1e9),
           "target": 20.0, "coef_step": 0.5, "max_coef": 1.0}


@pytest.mark.parametrize("plane", ["peer_to_peer", "coordinator"])
def test_entropy_control_through_the_peers_takes_the_local_step(
        plane: str, tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    config = tiny_run_config(tiny_model_dir, 2, swarm={"data_plane": plane},
                             train={"lr": 0.05, "entropy": ENTROPY})
    batch: TrainBatch = make_batch()
    local = local_trainer(tiny_model, config)
    with start_swarm(config, [(0, "training"), (1, "training")], local=True) as swarm:
        remote = swarm.remote_trainer()
        for _ in range(2):  # the second step applies the bonus (the first measured its entropy)
            got, expected = remote.train_step(batch), local.train_step(batch)
            for key in ("policy_loss", "entropy", "cov_selected_fraction", "grad_norm"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        assert got["entropy_coef"] == expected["entropy_coef"] == 0.5
        for peer, trainer in zip(swarm.peers, local.stage_trainers, strict=True):
            assert peer.training is not None
            remote_state = peer.training.model.state_dict()
            for name, value in trainer.stage.state_dict().items():
                torch.testing.assert_close(remote_state[name], value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("entropy", "inputs", "message"), [
    ({}, {"selected": True}, "with the selected tokens of entropy method 'none'"),
    ({"method": "clip_cov"}, {}, "without the selected tokens of entropy method 'clip_cov'"),
    ({"method": "clip_cov"}, {"selected": "narrow"}, "selected tokens of shape"),
    ({}, {"entropy_coef": 0.01}, "entropy bonus weight of 0.01, outside"),
    ({"target": 0.5, "max_coef": 0.1}, {"entropy_coef": 0.2}, "outside \\[0, 0.1\\]"),
])
def test_a_last_stage_refuses_entropy_inputs_the_run_does_not_have(
        entropy: dict[str, Any], inputs: dict[str, Any], message: str,
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 1, swarm={"data_plane": "coordinator"},
                             train={"entropy": entropy})
    batch = make_batch().select(slice(0, 2))
    selected = None
    if inputs.get("selected") is True:
        selected = torch.ones_like(batch.completion_valid)
    elif inputs.get("selected") == "narrow":
        selected = torch.ones_like(batch.completion_valid)[:, :1]
    loss_inputs = LossInputs(None, None, batch.num_policy_sequences, batch.num_target_tokens,
                             selected=selected, entropy_coef=inputs.get("entropy_coef", 0.0))
    with start_swarm(config, [(0, "training")], local=True) as swarm:
        (worker,) = swarm.workers()
        with pytest.raises(SwarmUnavailable, match=message):
            worker.forward(0, (batch.prompts, batch.completions), batch, loss_inputs)
        peer = swarm.peers[0]
        assert peer.training is not None and not peer.training.trainer.saved  # nothing kept
