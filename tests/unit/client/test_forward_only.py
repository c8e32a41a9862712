"""The forward-only pass of a batch through the training peers (the proximal log-probs of a batch
that takes several optimizer steps: learn/trainer.py `PipelineTrainer.proximal_logprobs`), pushed
down the chain (client/training_push.py, stage/training_push.py) or relayed stage by stage
(client/training.py, stage/training.py), in the protocols' local mode (net/local_node.py): the
same log-probs as the whole model in one process, nothing kept or changed on the peers, and a
request off the owner's route refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_helpers import Swarm, local_trainer, start_swarm, tiny_run_config

from decentrl.learn.batch import TrainBatch
from decentrl.model.loading import LoadedModel
from decentrl.net.node import RemoteError
from decentrl.net.protocol import TRAIN_LOGPROBS, TRAIN_LOGPROBS_CHAIN
from decentrl.net.push_messages import TrainingRoute, sign_training_route
from decentrl.net.training_messages import LogprobsChain, LogprobsForward
from tests.swarm.test_swarm import make_batch


def peer_state(swarm: Swarm) -> list[tuple[int, dict[str, torch.Tensor], int, int, int]]:
    """What a pass must not change on any training peer: its version, its weights, the
    micro-batches it holds for backward, its optimizer's state and the tapes it keeps."""
    state = []
    for peer in swarm.peers:
        assert peer.training is not None and peer.training_chain is not None
        trainer = peer.training.trainer
        state.append((trainer.version, {k: v.clone() for k, v in trainer.stage.state_dict().items()},
                      len(trainer.saved), len(trainer.optimizer.state),
                      len(peer.training_chain.tapes)))
    return state


def assert_unchanged(before: list[tuple[int, dict[str, torch.Tensor], int, int, int]],
                     after: list[tuple[int, dict[str, torch.Tensor], int, int, int]]) -> None:
    for (version, weights, *kept), (version_after, weights_after, *kept_after) in zip(
            before, after, strict=True):
        assert version_after == version
        assert kept_after == kept == [0, 0, 0]
        assert all(torch.equal(weights[name], weights_after[name]) for name in weights)


@pytest.mark.parametrize("plane", ["peer_to_peer", "coordinator"])
def test_the_forward_only_pass_gives_the_local_chains_logprobs(
        plane: str, tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    config = tiny_run_config(tiny_model_dir, 3, swarm={"data_plane": plane},
                             train={"minibatches_per_batch": 2, "micro_batch_size": 2},
                             trust={"train_audit_fraction": 1.0})  # peers would keep tapes
    batch: TrainBatch = make_batch()
    local = local_trainer(tiny_model, config)
    expected = local._chain_logprobs([t.stage for t in local.stage_trainers], batch)
    with start_swarm(config, [(s, "training") for s in range(3)], local=True) as swarm:
        trainer = swarm.remote_trainer()
        assert (trainer.chain is not None) == (plane == "peer_to_peer")
        before = peer_state(swarm)
        proximal = trainer.proximal_logprobs(batch)
        assert_unchanged(before, peer_state(swarm))
        # The same weights in one process: fp32 activations on the wire, so only the order of
        # sums differs (the log-probs are ~-3.4 nats).
        torch.testing.assert_close(proximal, expected, atol=1e-5, rtol=0)
        assert bool((proximal[~batch.completion_valid] == 0).all())
        # The pass left the chain ready to train on: the step scores its first minibatch
        # against the same numbers, so its ratios start at 1.
        metrics = trainer.train_step(batch)
        assert trainer.version == 2 and metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-4)


def test_a_forward_only_request_off_the_route_is_refused_and_changes_nothing(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, swarm={"data_plane": "peer_to_peer"})
    batch: TrainBatch = make_batch().select(slice(0, 2))
    with start_swarm(config, [(0, "training"), (1, "training")], local=True) as swarm:
        assert swarm.network is not None
        stranger = swarm.network.start_node("stranger")
        try:
            first, second = swarm.peer(0), swarm.peer(1)
            peers = [first.node.peer_id, second.node.peer_id]
            forward = LogprobsForward(micro=0, version=0, last=False)
            hidden = (torch.randn(*batch.prompts.shape, 32),
                      torch.randn(*batch.completions.shape, 32))
            tokens = (batch.prompts, batch.completions)
            owned = sign_training_route(swarm.client.identity,
                                        TrainingRoute(config.name, "", 0, peers))
            other_version = sign_training_route(swarm.client.identity,
                                                TrainingRoute(config.name, "", 1, peers))
            forged = sign_training_route(stranger.identity,
                                         TrainingRoute(config.name, "", 0, peers))
            exact = dict(batch.tensors())
            before = peer_state(swarm)
            cases = [
                # (why, sender, receiver, route, inputs, refusal, a strike): a request the
                # route does not allow is the sender's fault, even the owner's; a caller not
                # announced yet may be a peer whose announcement has not spread.
                ("the owner, where the route names stage 0's peer before stage 1",
                 swarm.client, second, owned, hidden, "names", True),
                ("a route the owner did not sign", first.node, second, forged, hidden,
                 "signed by", True),
                ("a route of another version than the micro-batch's", swarm.client, first,
                 other_version, tokens, "version", True),
                ("the stranger, who is not announced in stage 0", stranger, second, owned,
                 hidden, "not announced", False),
            ]
            for why, sender, receiver, route, inputs, refusal, struck in cases:
                strikes = receiver.node.strikes(sender.peer_id)
                with pytest.raises(RemoteError, match=refusal):
                    sender.call_sync(receiver.node.peer_id, TRAIN_LOGPROBS_CHAIN,
                                     LogprobsChain(route=route, forward=forward),
                                     {"prompt_in": inputs[0], "completion_in": inputs[1]},
                                     exact=exact, timeout=20)
                assert receiver.node.strikes(sender.peer_id) == strikes + struck, why
            # The relayed form is the coordinator's alone.
            with pytest.raises(RemoteError, match="coordinator"):
                stranger.call_sync(first.node.peer_id, TRAIN_LOGPROBS,
                                   LogprobsForward(micro=0, version=0, last=False),
                                   {"prompt_in": tokens[0], "completion_in": tokens[1]},
                                   exact=exact, timeout=20)
            assert first.node.strikes(stranger.peer_id) == 1
            assert_unchanged(before, peer_state(swarm))
            # The honest chain still answers.
            trainer = swarm.remote_trainer()
            assert trainer.proximal_logprobs(batch).shape == batch.completions.shape
        finally:
            stranger.shutdown()
