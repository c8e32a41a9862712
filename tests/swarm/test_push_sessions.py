"""Generation sessions whose activations travel from peer to peer (issue #36)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from swarm_helpers import (
    ObservedChain,
    Swarm,
    local_chain,
    serving,
    start_peer,
    start_swarm,
    tiny_run_config,
)

from decentrl.client.push_sessions import PushSession
from decentrl.config import RunConfig
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.launch.adversary import HostileInference
from decentrl.model.loading import LoadedModel, load_model
from decentrl.net.protocol import Role
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup
from decentrl.tasks import make_task
from decentrl.trust.verify import Verifier

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


def verifier(swarm: Swarm, config: RunConfig, model: LoadedModel) -> Verifier:
    directory = swarm.directory()
    return Verifier(swarm.client, directory, config, model.spec.hidden_size,
                    model.tokenizer.pad_token_id)


def one_group(swarm: Swarm, config: RunConfig, model: LoadedModel, chain: Any
              ) -> tuple[RolloutGroup, Any]:
    task = make_task(config.task.name, **config.task.options)
    worker = RolloutWorker(chain, None, task, model.tokenizer, config.rollout,
                           PromptScheduler(config.seed), config.seed)
    [group] = worker.generate_groups([0])
    return group, chain.sessions[-1]


def push_config(model_dir: Path, num_stages: int, **trust: Any) -> RunConfig:
    return tiny_run_config(model_dir, num_stages, rollout={"group_size": 4, "max_new_tokens": 8,
                                                           "temperature": 0.9},
                           swarm={"data_plane": "peer_to_peer", "request_timeout_s": 10.0},
                           trust={"verify_fraction": 1.0, **trust})


@pytest.mark.parametrize("kill", [None, "sender", "receiver-too"])
def test_a_failover_rebuilds_from_the_previous_stage_and_reveals_still_check(
        kill: str | None, tiny_sharp_dir: Path, sharp: LoadedModel) -> None:
    """Three stages, two replicas of stage 1 (one serves the session, one takes over or
    re-executes). `kill`: the serving stage-1 replica dies mid-session (the session is rebuilt
    at its replacement from what stage 0 kept, not from anything the coordinator holds; the dead
    replica's outputs are revealed by the stage-2 replica it pushed them to); with
    "receiver-too", stage 2's replica dies as well after the session, so nobody can reveal what
    the dead stage-1 replica sent: the check is skipped, nobody blamed."""
    config = push_config(tiny_sharp_dir, 3)
    layout: list[tuple[int, Role]] = [(0, "inference"), (0, "inference"), (1, "inference"),
                                      (1, "inference"), (1, "inference"), (2, "inference"),
                                      (2, "inference")]
    with start_swarm(config, layout) as swarm:
        killed: list[str] = []

        def after_step(session: PushSession, step: int) -> None:
            if kill is not None and step == 2:
                victim = session.peers[1]
                assert victim is not None
                killed.append(victim)
                swarm.kill(swarm.by_id(victim))

        chain = ObservedChain(swarm.chain(sharp.spec), after_step)
        group, session = one_group(swarm, config, sharp, chain)
        provenance = session.provenance
        if kill is None:
            assert session.failovers == 0
        else:
            assert session.failovers >= 1
            stage1 = provenance.stages[1]
            assert [peer for _, peer in stage1.served][0] == killed[0]
            assert len(stage1.served) == 2 and stage1.rebuilt == [stage1.served[1][0]]
            # The replacement was rebuilt from stage 0's outputs: stage 0 committed to a push of
            # the whole session to it.
            assert any(c.start == 0 and c.new > 1 for c in provenance.stages[0].commitments[1:])
        # The same samples as a chain that never failed (no weights changed).
        again, _ = one_group(swarm, config, sharp, ObservedChain(swarm.chain(sharp.spec)))
        assert [r.completion_tokens for r in group.rollouts] \
            == [r.completion_tokens for r in again.rollouts]
        if kill == "receiver-too":
            receiver = provenance.stages[1].commitments[0].receiver
            swarm.kill(swarm.by_id(receiver))
        check = verifier(swarm, config, sharp)
        panel = check.panel(provenance)
        assert panel is not None
        verdict = check.verify(group, provenance, panel)
        if kill == "receiver-too":
            assert verdict.outcome in ("skipped", "passed"), verdict
        else:
            assert verdict.outcome == "passed", verdict
            assert verdict.checked == (0, 1, 2)


@pytest.mark.parametrize(("adversary", "stage"), [("corrupt-activations", 0),
                                                  ("corrupt-activations", 1),
                                                  ("forge-logprobs", 2)])
def test_a_lie_pushed_on_is_revealed_and_blamed(adversary: str, stage: int,
                                                tiny_sharp_dir: Path,
                                                sharp: LoadedModel) -> None:
    config = push_config(tiny_sharp_dir, 3)
    layout: list[tuple[int, Role]] = [(s, "inference") for s in range(3)]
    with start_swarm(config, layout) as swarm:
        liar = start_peer(config, stage, "inference", swarm.client.addresses(),
                          swarm.client.peer_id, name="liar",
                          wrap_inference=lambda s: HostileInference(s, adversary))
        swarm.peers.append(liar)
        swarm.sockets.extend(liar.node.socket_paths())
        chain = swarm.chain(sharp.spec)
        honest = swarm.peer(stage).node.peer_id
        choose = chain.directory.choose_inference
        chain.directory.choose_inference = lambda at, allow_banned=False, avoid=frozenset(): (
            liar.node.peer_id if at == stage else choose(at, allow_banned, avoid))
        group, session = one_group(swarm, config, sharp, ObservedChain(chain))
        assert session.provenance.peers() >= {liar.node.peer_id}
        assert honest not in session.provenance.stage_peers(stage)
        check = verifier(swarm, config, sharp)
        panel = check.panel(session.provenance)
        assert panel is not None and panel[stage] == honest
        verdict = check.verify(group, session.provenance, panel)
        assert (verdict.outcome, verdict.stage, verdict.peer) \
            == ("failed", stage, liar.node.peer_id), verdict
