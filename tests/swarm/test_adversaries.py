"""Hostile peers in a live swarm (launch/adversary.py), each against the coordinator's defences:
it is detected, blamed on the right peer and stage, banned, and training goes on without it. And
the converse: honest replicas in bf16 and fp32 check each other many times and nobody is banned.

Every swarm here runs in this process over loopback, on the tiny model, with every accepted group
spot-checked (`trust.verify_fraction = 1`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from swarm_helpers import Swarm, serving, start_peer, start_swarm, tiny_run_config

from decentrl.client.sessions import RemoteChain
from decentrl.config import RunConfig
from decentrl.coordinator.loop import TrainingLoop
from decentrl.coordinator.manifest import admit
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.coordinator.worker import RolloutWorker
from decentrl.launch.adversary import (
    JUDGE_ADVERSARIES,
    HostileInference,
    LyingJudge,
    flood,
    submit_replays,
)
from decentrl.model.loading import LoadedModel, load_model
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.wire import TensorLimits
from decentrl.stage.peer import StagePeer
from decentrl.tasks import make_task
from decentrl.trust.verify import Verifier
from tests.swarm.test_swarm import make_batch

# Every test here starts a swarm of peers, each with its own p2p daemon.
pytestmark = pytest.mark.network

LAYOUT = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference")]


def trust_config(model_dir: Path, steps: int, **overrides: Any) -> RunConfig:
    return tiny_run_config(model_dir, 2, **{
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6,
                    "temperature": 0.9},
        "train": {"steps": steps, "micro_batch_size": 8, "max_staleness": 2,
                  "zero_variance_groups": "keep", "lr": 1e-3},
        "eval": {"problems": 4, "pass_k": 1, "max_new_tokens": 6, "batch_size": 4},
        "swarm": {"sessions_in_flight": 2, "announce_every_s": 1.0, "avoid_failed_peer_s": 2.0},
        "trust": {"verify_fraction": 1.0, "ban_s": 600.0, "flag_log_ratio": 1.0,
                  "flag_surprise": 3.0},
        **overrides})


def add_replica(swarm: Swarm, config: RunConfig, stage: int, name: str,
                adversary: str | None = None, collusion: Path | None = None) -> StagePeer:
    """An inference replica (hostile with `adversary`) joining `swarm` with its own `config`;
    shut down with the swarm."""
    judge = adversary in JUDGE_ADVERSARIES
    peer = start_peer(config, stage, "inference", swarm.client.addresses(),
                      swarm.client.peer_id, name=name,
                      wrap_inference=None if adversary is None or judge else
                      lambda service: HostileInference(service, adversary, collusion),
                      wrap_verification=LyingJudge if judge else None)
    swarm.peers.append(peer)
    swarm.sockets.extend(peer.node.socket_paths())
    return peer


def generation(swarm: Swarm, config: RunConfig, model_dir: Path
               ) -> tuple[LoadedModel, RemoteChain, RolloutWorker, PromptScheduler]:
    """What a test needs to generate groups through `swarm` itself, as the coordinator does."""
    model = load_model(str(model_dir))
    chain = swarm.chain(model.spec)
    task = make_task(config.task.name, **config.task.options)
    scheduler = PromptScheduler(config.seed)
    worker = RolloutWorker(chain, None, task, model.tokenizer, config.rollout, scheduler,
                           config.seed)
    return model, chain, worker, scheduler


@contextmanager
def coordinated(config: RunConfig, swarm: Swarm) -> Iterator[TrainingLoop]:
    # The training peers keep their checkpoints in the swarm's folder; the coordinator moves
    # its `latest` pointer in the run folder.
    (config.path / "checkpoints").mkdir(parents=True, exist_ok=True)
    admit(config.path, [p.node.peer_id for p in swarm.peers if p.training is not None])
    coordinator = swarm_run(config, swarm.client, Console(quiet=True))
    try:
        yield coordinator
    finally:
        coordinator.close()


def set_when(event: threading.Event, condition: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        if condition():
            event.set()
            return
        time.sleep(0.1)


def honest_ids(swarm: Swarm, hostile: list[StagePeer]) -> list[str]:
    bad = {p.node.peer_id for p in hostile}
    return [p.node.peer_id for p in swarm.peers if p.node.peer_id not in bad]


@pytest.mark.parametrize(("kind", "stages", "blamed_stage", "outcome"), [
    ("random-tokens", [1], 1, "failed"),
    ("forge-logprobs", [1], 1, "failed"),
    ("corrupt-activations", [0], 0, "failed"),
    # Lies only where the old fixed-point commitments never looked: the honest last stage it
    # feeds must not be blamed.
    ("corrupt-unopened", [0], 0, "failed"),
    ("inject-answers", [0, 1], 1, "failed"),
])
def test_hostile_replica_is_caught_blamed_and_banned(
        kind: str, stages: list[int], blamed_stage: int, outcome: str, tiny_sharp_dir: Path,
        tmp_path: Path) -> None:
    config = trust_config(tiny_sharp_dir, steps=6, host={"run_dir": str(tmp_path / "runs")})
    # The injector lies only in sessions its spy also serves, and earns passed checks in the
    # others: with the spy the only stage-0 replica, every one of its sessions is a lie, and a
    # short run bans it for sure.
    layout = [p for p in LAYOUT if kind != "inject-answers" or p != (0, "inference")]
    with start_swarm(config, layout) as swarm:
        hostile = [add_replica(swarm, config, stage, f"hostile{stage}", kind, tmp_path)
                   for stage in stages]
        culprit = hostile[-1].node.peer_id  # the pair's last-stage injector lies
        with coordinated(config, swarm) as coordinator:
            summary = coordinator.run(wait_s=60)
            reputation = coordinator.backend.trust.reputation
            events = [e for e in reputation.events if e.peer == culprit and e.outcome == outcome]
            assert events, f"{kind} was never caught: {reputation.events}"
            assert {e.stage for e in events} == {blamed_stage}
            assert reputation.banned(culprit)
            for peer in honest_ids(swarm, hostile):
                assert not reputation.banned(peer), reputation.counts(peer)
                assert reputation.counts(peer).get("failed", 0) == 0
            assert coordinator.backend.trust.count["verified"] > 0  # honest groups checked out
            assert summary.steps == config.train.steps


@pytest.mark.slow  # half a minute of daemons: make test-slow (CI runs it)
def test_a_colluding_judge_neither_saves_its_partner_nor_gets_an_honest_replica_blamed(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    # Every group checked, every pass repeated: the judge sits on many rulings. Two honest
    # replicas at the last stage, so that whoever produced a group, two others can judge it.
    # As many sessions at a time as the last stage has replicas: each of them gets work.
    config = trust_config(tiny_sharp_dir, steps=5, host={"run_dir": str(tmp_path / "runs")},
                          swarm={"sessions_in_flight": 4, "announce_every_s": 1.0, "avoid_failed_peer_s": 2.0},
                          trust={"verify_fraction": 1.0, "second_opinion_fraction": 1.0,
                                 "ban_s": 600.0, "flag_log_ratio": 1.0, "flag_surprise": 3.0})
    layout = [*LAYOUT, (1, "inference")]
    with start_swarm(config, layout) as swarm:
        partner = add_replica(swarm, config, 1, "partner", "forge-logprobs")
        judge = add_replica(swarm, config, 1, "judge", "collude-verify")
        with coordinated(config, swarm) as coordinator:
            summary = coordinator.run(wait_s=60)
            trust = coordinator.backend.trust
            reputation = trust.reputation
            assert reputation.banned(partner.node.peer_id), reputation.counts(partner.node.peer_id)
            assert trust.count["verifiers_overruled"] > 0
            assert reputation.counts(judge.node.peer_id).get("failed", 0) > 0
            for peer in honest_ids(swarm, [partner, judge]):
                assert reputation.counts(peer).get("failed", 0) == 0, reputation.counts(peer)
                assert not reputation.banned(peer)
            assert summary.steps == config.train.steps


@pytest.mark.slow  # half a minute of daemons: make test-slow (CI runs it)
def test_two_newcomers_lying_as_verifiers_frame_nobody(tiny_sharp_dir: Path,
                                                       tmp_path: Path) -> None:
    # Issue 32's attack: two new identities that serve honestly and lie only as verifiers, at the
    # stage of an honest replica judged by its admitted training peer. Every group checked,
    # every pass repeated; they stay on probation all run. Before, the admitted peer's pass was
    # repeated by one of them and the other decided: the honest replica was banned, the admitted
    # peer charged. Now a second opinion comes from established peers only.
    config = trust_config(tiny_sharp_dir, steps=4, host={"run_dir": str(tmp_path / "runs")},
                          swarm={"sessions_in_flight": 4, "announce_every_s": 1.0, "avoid_failed_peer_s": 2.0},
                          trust={"verify_fraction": 1.0, "second_opinion_fraction": 1.0,
                                 "probation_checks": 1000, "ban_s": 600.0,
                                 "flag_log_ratio": 1.0, "flag_surprise": 3.0})
    with start_swarm(config, LAYOUT) as swarm:
        framers = [add_replica(swarm, config, 1, f"framer{i}", "collude-verify")
                   for i in range(2)]
        with coordinated(config, swarm) as coordinator:
            summary = coordinator.run(wait_s=60)
            trust = coordinator.backend.trust
            reputation = trust.reputation
            for peer in honest_ids(swarm, framers):
                assert reputation.counts(peer).get("failed", 0) == 0, reputation.counts(peer)
                assert not reputation.banned(peer)
            assert trust.count["verify_failed"] == 0 and trust.count["verifiers_overruled"] == 0
            assert trust.count["verified"] > 0  # honest groups checked out
            assert all(reputation.on_probation(f.node.peer_id) for f in framers)
            assert summary.steps == config.train.steps


def test_replayed_submissions_are_refused_before_any_of_them_is_read(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """The coordinator serves no inbox to other peers (net/swarm_transport.py): a replayed group
    is refused when its stream opens, and nothing of it reaches the coordinator."""
    config = trust_config(tiny_sharp_dir, steps=3, host={"run_dir": str(tmp_path / "runs")})
    with start_swarm(config, LAYOUT) as swarm:
        attacker = SwarmNode.start("replayer", swarm.client.addresses(), LinkProfile(),
                                   TensorLimits())
        swarm.sockets.extend(attacker.socket_paths())
        stop, accepted = threading.Event(), threading.Event()
        refused: list[int] = []
        thread = threading.Thread(target=lambda: refused.append(
            submit_replays(attacker, config, swarm.client.peer_id, stop, every_s=0.3,
                           start=accepted)), daemon=True)
        try:
            with coordinated(config, swarm) as coordinator:
                thread.start()
                # The replays start once the coordinator has generated a group of its own.
                threading.Thread(target=set_when, daemon=True, args=(
                    accepted, lambda: bool(coordinator.backend.trust.provenance), stop)).start()
                summary = coordinator.run(wait_s=60)
                assert swarm.client.strikes(attacker.peer_id) == 0
                assert summary.steps == config.train.steps
        finally:
            stop.set()
            thread.join(30)
            attacker.shutdown()
    assert refused and refused[0] > 0


def test_a_flood_of_malformed_requests_is_blocked_by_the_peers_it_reaches(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    """Its malformed requests to stage peers are strikes there, until they block it; its
    submissions to the coordinator are refused when their stream opens (no inbox is served to
    other peers), so the coordinator reads nothing of it."""
    config = trust_config(tiny_sharp_dir, steps=3, host={"run_dir": str(tmp_path / "runs")},
                          trust={"verify_fraction": 0.0, "strikes_to_block": 5})
    with start_swarm(config, LAYOUT) as swarm:
        attacker = SwarmNode.start("flooder", swarm.client.addresses(), LinkProfile(),
                                   TensorLimits())
        swarm.sockets.extend(attacker.socket_paths())
        stop = threading.Event()
        thread = threading.Thread(target=flood,
                                  args=(attacker, config, swarm.client.peer_id, stop, 0.02),
                                  daemon=True)
        try:
            with coordinated(config, swarm) as coordinator:
                thread.start()
                summary = coordinator.run(wait_s=60)
                reputation = coordinator.backend.trust.reputation
                blocked = [p for p in swarm.peers if p.node.blocked(attacker.peer_id)]
                assert blocked, [p.node.strikes(attacker.peer_id) for p in swarm.peers]
                assert swarm.client.strikes(attacker.peer_id) == 0
                assert summary.steps == config.train.steps
                for peer in swarm.peers:
                    assert not reputation.banned(peer.node.peer_id)
        finally:
            stop.set()
            thread.join(30)
            attacker.shutdown()


def test_honest_bf16_and_fp32_replicas_pass_each_others_checks(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    config = trust_config(tiny_sharp_dir, steps=1)
    bf16 = config.with_host(config.host.model_copy(update={"dtype": "bf16"}))
    with start_swarm(config, [(0, "inference"), (1, "inference")]) as swarm:
        # A bf16 replica beside each fp32 one: every check re-executes on the other dtype.
        for stage in (0, 1):
            add_replica(swarm, bf16, stage, f"bf16-{stage}")
        model, chain, worker, scheduler = generation(swarm, config, tiny_sharp_dir)
        verifier = Verifier(swarm.client, chain.directory, config, model.spec.hidden_size,
                            model.tokenizer.pad_token_id)

        def generate(index: int) -> tuple[Any, Any]:
            sessions: list[Any] = []
            [group] = worker.generate_groups([index], on_session=sessions.append)
            return group, sessions[0].provenance

        # Two sessions at a time, as the coordinator runs them: they spread over the replicas.
        with ThreadPoolExecutor(2) as pool:
            generated = list(pool.map(generate, scheduler.next(24)))
        served: set[str] = set()
        for group, provenance in generated:
            verdict = verifier.verify(group, provenance, verifier.panel(provenance))
            assert verdict.outcome == "passed", verdict
            assert verdict.checked == (0, 1)  # by the other replica of each stage
            served |= provenance.peers()
        # Both dtypes did original work (so both re-executed the other's).
        assert served == {peer.node.peer_id for peer in swarm.peers}


@pytest.mark.parametrize("history", [2, 0])
def test_a_check_rewinds_the_verifier_to_the_recorded_version(
        history: int, tiny_sharp_dir: Path) -> None:
    """A group sampled at v0 is checked after the replicas moved to v1: the verifier rewinds
    (exactly: its served weights are the v1 ones afterwards), or, keeping no history, refuses and
    the check is skipped (nobody is blamed)."""
    config = trust_config(tiny_sharp_dir, steps=1,
                          train={"max_staleness": history, "micro_batch_size": 8},
                          trust={"history_versions": history, "verify_fraction": 1.0})
    layout = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference"),
              (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        model, chain, worker, scheduler = generation(swarm, config, tiny_sharp_dir)
        sessions: list[Any] = []
        [group] = worker.generate_groups(scheduler.next(1), on_session=sessions.append)
        assert group.stage_versions == [0, 0]
        swarm.remote_trainer().train_step(make_batch())
        replicas = [p for p in swarm.peers if p.role == "inference"]
        for replica in replicas:
            # Their follow loops fetch v1 by themselves; this only waits for it (a dial to the
            # publisher can fail once while the daemons are young: the loop tries again).
            deadline = time.monotonic() + 60
            while replica.version != 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert replica.version == 1
        served = {p.node.peer_id: {k: v.clone() for k, v in
                                   serving(p).model.state_dict().items()} for p in replicas}
        chain.directory.refresh()
        verifier = Verifier(swarm.client, chain.directory, config, model.spec.hidden_size,
                            model.tokenizer.pad_token_id)
        verdict = verifier.verify(group, sessions[0].provenance,
                                  verifier.panel(sessions[0].provenance))
        if history:
            assert verdict.outcome == "passed", verdict
        else:
            assert verdict.outcome == "skipped" and "version" in verdict.detail, verdict
        for replica in replicas:
            assert replica.version == 1
            for name, tensor in serving(replica).model.state_dict().items():
                assert torch.equal(tensor, served[replica.node.peer_id][name]), name


def test_a_liar_at_unopened_positions_is_blamed_not_the_stage_it_fed(
        tiny_sharp_dir: Path) -> None:
    """A stage-0 replica that corrupts only positions whose id is not a multiple of 8 (what the
    old fixed-point commitments never opened) serves every session; the honest last stage
    computes on its lie. A check on replicas that joined later fails and blames the liar at
    stage 0, never the honest stage 1."""
    config = trust_config(tiny_sharp_dir, steps=1)
    with start_swarm(config, [(1, "inference"), (1, "inference")]) as swarm:
        liar = add_replica(swarm, config, 0, "unopened", "corrupt-unopened").node.peer_id
        model, chain, worker, scheduler = generation(swarm, config, tiny_sharp_dir)
        generated = []
        for index in scheduler.next(3):
            sessions: list[Any] = []
            [group] = worker.generate_groups([index], on_session=sessions.append)
            generated.append((group, sessions[0].provenance))
        add_replica(swarm, config, 0, "honest0")
        chain.directory.refresh()
        verifier = Verifier(swarm.client, chain.directory, config, model.spec.hidden_size,
                            model.tokenizer.pad_token_id)
        for group, provenance in generated:
            assert provenance.stage_peers(0) == {liar}
            verdict = verifier.verify(group, provenance, verifier.panel(provenance))
            assert (verdict.outcome, verdict.stage, verdict.peer) == ("failed", 0, liar), verdict
