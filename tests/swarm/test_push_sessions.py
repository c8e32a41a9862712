"""Generation sessions whose activations travel from peer to peer (issue #36)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import local_chain, serving, start_swarm, tiny_run_config

from decentrl.client.push_sessions import PushSession
from decentrl.model.loading import LoadedModel, load_model
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig

pytestmark = pytest.mark.network

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40)


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


def run(chain: Any, sampling: SamplingConfig = GREEDY, seed: int | None = None) -> list[Any]:
    return generate(chain, PROMPTS, 10, sampling, set(), 0, seed)


def test_pushed_generation_matches_local(tiny_sharp_dir: Path, sharp: LoadedModel) -> None:
    config = tiny_run_config(tiny_sharp_dir, 3, swarm={"data_plane": "peer_to_peer"})
    with start_swarm(config, [(0, "inference"), (1, "inference"), (2, "inference")]) as swarm:
        chain = swarm.chain(sharp.spec)
        sessions: list[PushSession] = []
        got = generate(chain, PROMPTS, 10, GREEDY, set(), 0, None, on_session=sessions.append)
        expected = run(local_chain(sharp, 3))
        assert [g.tokens for g in got] == [g.tokens for g in expected]
        assert isinstance(sessions[0], PushSession)
        commitments = sessions[0].provenance.stages[0].commitments
        assert len(commitments) == 10 and all(len(c.rows) == 3 for c in commitments)
        sampled = run(chain, SAMPLED, seed=7)
        assert [g.tokens for g in sampled] == [g.tokens for g in run(local_chain(sharp, 3),
                                                                    SAMPLED, seed=7)]
        assert chain.failovers == 0
        assert all(not serving(p).sessions for p in swarm.peers)
