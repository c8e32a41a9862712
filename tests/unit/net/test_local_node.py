"""The protocols' local mode (net/local_node.py): a whole swarm in this process, no p2p daemon,
the same guard, strikes and emulated links; here with the peer-to-peer sessions of issue #36."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_helpers import local_chain, start_swarm, tiny_run_config

from decentrl.client.push_sessions import PushSession
from decentrl.model.loading import LoadedModel, load_model
from decentrl.net.link import LinkProfile
from decentrl.net.local_node import LocalNetwork
from decentrl.net.node import RemoteError
from decentrl.net.protocol import INFERENCE_PUSH
from decentrl.net.push_messages import PushStep
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from tests.swarm.test_push_training import relayed_and_pushed_step

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40)
# Every link of every node: 4-6 ms round trips, 200 Mbit/s each way.
LINK = LinkProfile(rtt_ms=(4.0, 6.0), bandwidth_mbps=200.0, seed=3)


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


def test_pushed_sessions_in_local_mode_match_one_process(tiny_sharp_dir: Path,
                                                         sharp: LoadedModel) -> None:
    config = tiny_run_config(tiny_sharp_dir, 3, swarm={"data_plane": "peer_to_peer"})
    layout = [(0, "inference"), (1, "inference"), (2, "inference")]
    with start_swarm(config, layout, local=True, client_link=LINK, peer_link=LINK) as swarm:
        chain = swarm.chain(sharp.spec)
        sessions: list[PushSession] = []
        for sampling, seed in ((GREEDY, None), (SAMPLED, 7)):
            got = generate(chain, PROMPTS, 8, sampling, set(), 0, seed,
                           on_session=sessions.append)
            expected = generate(local_chain(sharp, 3), PROMPTS, 8, sampling, set(), 0, seed)
            assert [g.tokens for g in got] == [g.tokens for g in expected]
        assert isinstance(sessions[0], PushSession) and chain.failovers == 0
        # The activations went stage to stage over the emulated links: stage 0's link to
        # stage 1 carried hidden states (8 steps of 3 rows of 32 floats at least), the
        # client's links only token ids, log-probs and commitments.
        first, second = swarm.peer(0).node, swarm.peer(1).node
        assert first.links is not None and swarm.client.links is not None
        hidden_bytes = first.links.link(second.peer_id).stats.bytes_out
        assert hidden_bytes > 8 * 3 * 32 * 4
        client_to_first = swarm.client.links.link(first.peer_id).stats.bytes_out
        assert client_to_first < hidden_bytes


def test_local_mode_keeps_the_guard(tiny_sharp_dir: Path) -> None:
    """Who may push, and what an unsigned or foreign push costs, are the same as over daemons."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"data_plane": "peer_to_peer"},
                             trust={"strikes_to_block": 2})
    with start_swarm(config, [(0, "inference"), (1, "inference")], local=True) as swarm:
        assert swarm.network is not None
        stranger = swarm.network.start_node("stranger")
        try:
            first, second = swarm.peer(0).node, swarm.peer(1).node
            push = PushStep(route=b"", start=0, fresh=1, session="s", commits=[],
                            sampling=GREEDY, seed=None)
            tensors = {"inputs": torch.zeros(1, 1, 32), "positions": torch.zeros(1, 1,
                                                                                 dtype=torch.long),
                       "key_valid": torch.ones(1, 1, dtype=torch.bool)}
            # The callers policy: stage 1 takes pushes from stage 0's announced peers only, and
            # refuses a stranger without a strike (it may be a replica not announced yet)...
            with pytest.raises(RemoteError, match="not announced there"):
                stranger.call_sync(second.peer_id, INFERENCE_PUSH, push, tensors)
            assert second.strikes(stranger.peer_id) == 0
            # ...stage 0 from the owner only: a strike each time, then a block.
            for _ in range(2):
                with pytest.raises(RemoteError, match="coordinator"):
                    stranger.call_sync(first.peer_id, INFERENCE_PUSH, push, tensors)
            assert first.blocked(stranger.peer_id)
            with pytest.raises(RemoteError, match="blocked"):
                stranger.call_sync(first.peer_id, INFERENCE_PUSH, push, tensors)
            # A node that left answers nothing.
            gone = swarm.network.start_node("gone")
            gone.shutdown()
            with pytest.raises(RemoteError, match="no such peer"):
                swarm.client.call_sync(gone.peer_id, INFERENCE_PUSH, push, tensors)
        finally:
            stranger.shutdown()


def test_pushed_training_in_local_mode(tiny_model_dir: Path) -> None:
    relayed_and_pushed_step(3, tiny_model_dir, local=True)


def test_local_mode_refuses_a_lossy_link() -> None:
    with pytest.raises(ValueError, match="not loss"):
        LocalNetwork().start_node("lossy", LinkProfile(loss=0.1))
