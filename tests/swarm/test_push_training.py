"""Training micro-batches pushed down the chain of training peers (issue #36): the coordinator's
link carries the micro-batch and the row statistics, not the activations and gradients; every
stage takes a micro-batch only under the owner's route, from the peer it names before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_helpers import start_node, start_swarm, tiny_run_config

from decentrl.client.training import RemoteStageWorker
from decentrl.learn.batch import TrainBatch
from decentrl.net.link import LinkProfile
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import TRAIN_CHAIN, TRAIN_TAPE
from decentrl.net.push_messages import TrainingRoute, sign_training_route
from decentrl.net.training_messages import TapeRequest, TrainChain, TrainForward
from decentrl.net.wire import TensorLimits
from tests.swarm.test_swarm import make_batch

pytestmark = pytest.mark.network


def client_bytes(node: SwarmNode) -> int:
    assert node.links is not None
    return node.links.total_bytes()


@pytest.mark.parametrize("stages", [2, 3])
def test_a_pushed_step_moves_no_activation_through_the_coordinator(
        stages: int, tiny_model_dir: Path) -> None:
    relayed_and_pushed_step(stages, tiny_model_dir, local=False)


def relayed_and_pushed_step(stages: int, tiny_model_dir: Path, local: bool) -> None:
    """The same step relayed and pushed: the same weights after it, and the coordinator's
    bytes of the pushed one are the micro-batch and a few hundred bytes per stage. `local`:
    in the protocols' local mode (net/local_node.py)."""
    moved = {}
    weights = {}
    for plane in ("coordinator", "peer_to_peer"):
        config = tiny_run_config(tiny_model_dir, stages, codec="bf16",
                                 train={"lr": 0.05, "micro_batch_size": 2},
                                 swarm={"data_plane": plane},
                                 trust={"train_audit_fraction": 1.0})  # peers keep tapes
        with start_swarm(config, [(s, "training") for s in range(stages)],
                         local=local) as swarm:
            trainer = swarm.remote_trainer()
            batch = make_batch()
            before = client_bytes(swarm.client)
            trainer.train_step(batch)
            moved[plane] = client_bytes(swarm.client) - before
            if plane == "peer_to_peer":
                # What an audit would replay: every micro-batch as each peer received and sent
                # it, revealed and checked against the commitments.
                for worker in trainer.workers:
                    assert isinstance(worker, RemoteStageWorker) and worker.revealed is not None
                    tape = worker.revealed(0)
                    assert len(tape.forwards) == len(tape.backwards) == 3  # 6 rows, 2 a micro
                    body, inputs, _, out = tape.forwards[0]
                    assert body.last == worker.last and set(out) == (
                        {"row_surprise", "row_log_ratio"} if worker.last
                        else {"prompt_out", "completion_out"})
                    assert (worker.stage == 0) == (inputs["prompt_in"].dtype == torch.long)
            weights[plane] = [{k: v.clone() for k, v in p.training.model.state_dict().items()}
                              for p in swarm.peers if p.training is not None]
    for relayed, pushed in zip(weights["coordinator"], weights["peer_to_peer"], strict=True):
        for name, value in relayed.items():
            # Adam's first step moves a weight by about ±lr (0.05) whatever its gradient's size,
            # except where the gradient is near eps: there a last-bit difference in a sum
            # (thread scheduling differs between runs) moves it by up to ~1e-5 of lr's scale.
            # A gradient lost or misrouted moves weights by a good fraction of lr.
            torch.testing.assert_close(pushed[name], value, atol=5e-4, rtol=0)
    assert moved["peer_to_peer"] < moved["coordinator"] / 2, moved


def test_micro_batches_from_anyone_but_the_route_are_refused_and_struck(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, 2, swarm={"data_plane": "peer_to_peer"})
    with start_swarm(config, [(0, "training"), (1, "training")]) as swarm:
        first, second = swarm.peer(0), swarm.peer(1)
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        try:
            batch: TrainBatch = make_batch().select(slice(0, 2))
            forward = TrainForward(micro=0, version=0, last=False, total_sequences=2,
                                   total_tokens=batch.num_target_tokens)
            hidden = torch.randn(*batch.prompts.shape, 32), torch.randn(*batch.completions.shape,
                                                                        32)
            route = TrainingRoute(config.name, "", 0, [first.node.peer_id,
                                                        second.node.peer_id])
            owned = sign_training_route(swarm.client.identity, route)
            forged = sign_training_route(stranger.identity, route)
            exact = dict(batch.tensors())
            cases = [
                # The route names stage 0's training peer before stage 1, not the owner...
                ("the owner, where the route names another", swarm.client, owned),
                # ...and only the owner signs routes.
                ("a route the owner did not sign", first.node, forged),
            ]
            for why, sender, signed in cases:
                before = second.node.strikes(sender.peer_id)
                with pytest.raises(RemoteError):
                    sender.call_sync(second.node.peer_id, TRAIN_CHAIN,
                                     TrainChain(route=signed, forward=forward),
                                     {"prompt_in": hidden[0], "completion_in": hidden[1]},
                                     exact=exact, timeout=20)
                if sender is not swarm.client:  # the owner is never struck
                    assert second.node.strikes(sender.peer_id) == before + 1, why
            with pytest.raises(RemoteError, match="not announced"):
                stranger.call_sync(second.node.peer_id, TRAIN_CHAIN,
                                   TrainChain(route=owned, forward=forward),
                                   {"prompt_in": hidden[0], "completion_in": hidden[1]},
                                   exact=exact, timeout=20)
            with pytest.raises(RemoteError, match="coordinator"):
                stranger.call_sync(first.node.peer_id, TRAIN_TAPE,
                                   TapeRequest(version=0, micro=0), timeout=20)
            # Nothing moved: the honest chain still trains.
            assert first.version == 0 and second.version == 0
            swarm.remote_trainer().train_step(make_batch())
            assert first.version == 1 and second.version == 1
        finally:
            stranger.shutdown()
