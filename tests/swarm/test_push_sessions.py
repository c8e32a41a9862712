"""Generation sessions whose activations travel from peer to peer (issue #36)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from swarm_helpers import (
    ObservedChain,
    Swarm,
    local_chain,
    serving,
    start_node,
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
from decentrl.net.directory import SwarmUnavailable
from decentrl.net.link import LinkProfile
from decentrl.net.node import RemoteError
from decentrl.net.protocol import INFERENCE_PUSH, INFERENCE_RESULT, INFERENCE_RESUME, REVEAL, Role
from decentrl.net.push_messages import (
    PushStep,
    ResultRequest,
    ResumeRequest,
    RevealRequest,
    StepCommit,
    chain_digest,
    open_route,
    row_digests,
    sign_commit,
    sign_route,
)
from decentrl.net.wire import TensorLimits
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import RolloutGroup
from decentrl.stage.inference import SESSION_IDLE_S
from decentrl.stage.peer import StagePeer
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
        assert len(commitments) == 10 and all(len(c.digest) == 32 for c in commitments)
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


def test_pushes_from_anyone_but_the_route_are_refused_and_struck(
        tiny_sharp_dir: Path, sharp: LoadedModel) -> None:
    """Stage 1 takes a session's pushes from the stage-0 replica its route names only, with
    inputs that hash to what that replica signed, under a route the run's owner signed; every
    other push is refused, and counted against its sender. The coordinator's own RPCs (collect,
    resume, reveal) are refused from anyone else."""
    config = push_config(tiny_sharp_dir, 2)
    layout: list[tuple[int, Role]] = [(0, "inference"), (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        chain = ObservedChain(swarm.chain(sharp.spec))
        one_group(swarm, config, sharp, chain)
        [session] = chain.sessions
        routed, other = (swarm.by_id(p) for p in (
            session.peers[0], next(p.node.peer_id for p in swarm.peers
                                   if p.index == 0 and p.node.peer_id != session.peers[0])))
        target = swarm.peer(1)
        hidden = torch.randn(4, 1, sharp.spec.hidden_size)
        valid = torch.ones(4, 1, dtype=torch.bool)
        positions = torch.full((4, 1), 3)

        def push(sender: StagePeer, route: bytes, signer: StagePeer, signed: torch.Tensor,
                 inputs: torch.Tensor) -> None:
            commit = StepCommit(session.id, session.epoch, 0, session.length, 1, 0, b"",
                                chain_digest(row_digests(signed)))
            body = PushStep(route=route, start=session.length,
                            commits=[sign_commit(signer.node.identity, commit)],
                            sampling=GREEDY, seed=None)
            sender.node.call_sync(target.node.peer_id, INFERENCE_PUSH, body,
                                  {"inputs": inputs, "positions": positions, "key_valid": valid},
                                  timeout=10)

        forged_route = sign_route(other.node.identity, open_route(session.signed_route,
                                                                  swarm.client.peer_id))
        narrow = hidden[..., :sharp.spec.hidden_size // 2].contiguous()
        cases = [
            ("a stage-0 replica the route does not name", other, session.signed_route, other,
             hidden, hidden),
            ("inputs that do not hash to the signed digests", routed, session.signed_route,
             routed, hidden + 1, hidden),
            ("a route the owner did not sign", routed, forged_route, routed, hidden, hidden),
            ("hidden states of the wrong width, signed as such", routed, session.signed_route,
             routed, narrow, narrow),
        ]
        for why, sender, route, signer, signed, inputs in cases:
            before = target.node.strikes(sender.node.peer_id)
            with pytest.raises(RemoteError):
                push(sender, route, signer, signed, inputs)
            assert target.node.strikes(sender.node.peer_id) == before + 1, why
        for rpc, body in [(INFERENCE_RESULT, ResultRequest(session.id, 0)),
                          (REVEAL, RevealRequest(session.id, 0, 1, [(0, 0, 1)])),
                          (INFERENCE_RESUME, ResumeRequest(session.signed_route, 0))]:
            before = routed.node.strikes(other.node.peer_id)
            with pytest.raises(RemoteError, match="coordinator"):
                other.node.call_sync(routed.node.peer_id, rpc, body, timeout=10)
            assert routed.node.strikes(other.node.peer_id) == before + 1, rpc.method
        # A stranger that is not announced at stage 0 is refused before its push is read.
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        try:
            with pytest.raises(RemoteError, match="not announced"):
                stranger.call_sync(target.node.peer_id, INFERENCE_PUSH, PushStep(
                    route=session.signed_route, start=0), {"inputs": hidden,
                                                           "positions": positions,
                                                           "key_valid": valid}, timeout=10)
        finally:
            stranger.shutdown()
        # Stage 1 still reveals (to the owner) what the routed replica pushed it, and that is
        # what the routed replica committed to.
        sent = session.provenance.stages[0].commitments
        steps = [(c.epoch, c.start, c.new) for c in sent]
        reply, out = swarm.client.call_sync(target.node.peer_id, REVEAL, RevealRequest(
            session.id, 0, 4, steps, received=True))
        assert out["outputs"].shape[:2] == (4, session.length)
        assert [chain_digest(d) for d in reply.digests] == [c.digest for c in sent]


def test_kept_activations_are_bounded(tiny_sharp_dir: Path, sharp: LoadedModel) -> None:
    """A peer that keeps as much of what it sent as `swarm.kept_activations_mb` allows takes no
    new session (the session moves on, nothing kept is forgotten early); sessions closed longer
    than the reveal window ago are forgotten."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"data_plane": "peer_to_peer",
                                                       "kept_activations_mb": 0.001})
    with start_swarm(config, [(0, "inference"), (1, "inference")]) as swarm:
        chain = swarm.chain(sharp.spec)
        run(chain)  # 3 rows x 14 columns x 32 floats: over the 1 KiB allowed
        push = swarm.peer(0).push
        assert push is not None and push.kept_bytes > 1024
        with pytest.raises(SwarmUnavailable, match="kept_activations_mb"):
            run(chain)
        later = time.monotonic() + SESSION_IDLE_S + config.trust.reveal_window_s + 1
        for peer in swarm.peers:
            assert peer.push is not None
            peer.push.expire(now=later)
            assert peer.push.kept_bytes == 0
        run(chain)
