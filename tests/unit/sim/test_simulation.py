"""The simulator's invariants on small runs (sim/): work is conserved (every byte sent is received,
every group produced is trained, dropped for a stated reason or still pending), no count goes
negative, a seed gives the same run and another seed another, the real policies bound what they
bound (staleness, rows in flight), and the designs and trust work change what they should."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from decentrl.config import RunConfig
from decentrl.sim.machines import HARDWARE
from decentrl.sim.run import SimReport, Simulation
from decentrl.sim.scenario import (
    CoordinatorSpec,
    Kill,
    LinkSpec,
    PeerSpec,
    Scenario,
    Workload,
)
from decentrl.sim.shapes import SMOLLM2_135M

GPU = next(name for name, profile in HARDWARE.items() if profile.kind == "nvidia")
LINKS = LinkSpec({("eu", "eu"): 20.0, ("eu", "us"): 100.0, ("us", "us"): 20.0},
                 uplink_mbps=50.0, downlink_mbps=200.0)


def config(max_new_tokens: int = 12, checkpoint_every: int = 25, steps: int = 100,
           **trust: Any) -> RunConfig:
    return RunConfig.model_validate({
        "name": "sim", "num_stages": 2,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": max_new_tokens},
        "train": {"max_staleness": 2, "micro_batch_size": 8,
                  "checkpoint_every": checkpoint_every, "steps": steps},
        "trust": {"history_versions": 4, **trust}})


def peers(**changes: Any) -> tuple[PeerSpec, ...]:
    """A training peer and two replicas per stage, one of them in another region behind NAT."""
    found = []
    for stage in range(2):
        found.append(PeerSpec(f"train{stage}", stage, "training", GPU, "eu"))
        for index in range(2):
            found.append(PeerSpec(f"infer{stage}.{index}", stage, "inference", GPU,
                                  "eu" if index == 0 else "us", behind_nat=index == 1))
    return tuple(dataclasses.replace(p, **changes.get(p.name, {})) for p in found)


def scenario(**fields: Any) -> Scenario:
    values: dict[str, Any] = {
        "config": config(), "shape": SMOLLM2_135M, "peers": peers(),
        "coordinator": CoordinatorSpec("eu"), "links": LINKS,
        "workload": Workload(prompt_tokens=16), "duration_s": 60.0, "seed": 1}
    values.update(fields)
    return Scenario(**values)


def run(**fields: Any) -> tuple[SimReport, Simulation]:
    simulation = Simulation(scenario(**fields))
    return simulation.run(), simulation


def test_work_is_conserved_and_no_count_goes_negative() -> None:
    report, simulation = run()
    world = simulation.world
    endpoints = world.network.endpoints.values()
    # Every byte sent arrived (a message is counted once delivered).
    assert sum(e.sent for e in endpoints) == sum(e.received for e in endpoints) > 0
    # Every group produced is trained, dropped for a reason, or still pending.
    groups = report.groups
    dropped = sum(count for reason, count in groups.items() if reason.startswith("dropped"))
    assert groups["produced"] == groups["trained"] + dropped + simulation.groups_pending()
    assert groups["trained"] == world.config.rollout.prompts_per_step * report.figures["steps"]
    assert report.figures["steps"] > 0 and report.figures["generated_tokens_per_s"] > 0
    # Counts of open sessions never go negative, and the sessions respect the policy's limit.
    assert all(r.sessions >= 0 for stage in world.replicas for r in stage)
    assert 0 <= simulation.generation.running <= simulation.generation.inflight.max_sessions
    # What the real staleness check admits is what was trained.
    assert max(report.staleness) <= world.config.train.max_staleness
    assert sum(report.staleness.values()) == groups["trained"]
    assert all(0 <= share <= 1.0 + 1e-9 for share in report.utilization.values())
    # A decoding step's time is all accounted for: links, replicas, the coordinator's CPU (the
    # parts also hold the steps under way when the run ends, a few in thousands).
    figures = report.figures
    parts = sum(figures[f"decode_{part}_s"] for part in ("network", "replica", "coordinator"))
    assert parts == pytest.approx(figures["decode_round_trip_s"], rel=0.01)


def test_a_seed_gives_the_same_run_and_another_seed_another() -> None:
    first, _ = run(seed=3)
    again, _ = run(seed=3)
    other, _ = run(seed=4)
    assert first == again
    assert other != first


def test_activations_peer_to_peer_leave_the_coordinator_the_tokens() -> None:
    relayed, _ = run(data_plane="coordinator")
    direct, _ = run(data_plane="peer_to_peer")
    through = relayed.figures["coordinator_received_mb"] + relayed.figures["coordinator_sent_mb"]
    assert direct.figures["coordinator_received_mb"] + direct.figures["coordinator_sent_mb"] \
        < through / 3
    # The NAT'd replicas of two stages now talk to each other: through a relay.
    assert direct.figures["relayed_mb"] > 0 == relayed.figures["relayed_mb"]


def test_a_checked_adversary_is_banned_and_none_of_its_groups_train() -> None:
    report, simulation = run(config=config(verify_fraction=1.0),
                             peers=peers(**{"infer0.0": {"adversary": True}}))
    assert report.figures["bans"] == 1 and "infer0.0" in simulation.world.banned
    assert report.groups["dropped: failed its spot check"] >= 1
    assert "trained unchecked from an adversary" not in report.groups
    assert report.figures["spot_checks"] == report.groups["produced"] \
        - report.groups.get("dropped: producer banned", 0)
    assert 0 < report.figures["verify_share_of_replica_compute"] < 1


def test_a_replica_that_leaves_mid_run_is_failed_over() -> None:
    # Long sessions: both stage-1 replicas serve one when infer1.0 leaves.
    report, simulation = run(config=config(max_new_tokens=256),
                             peers=peers(**{"infer1.0": {"leaves_at_s": 5.0}}),
                             duration_s=240.0)
    assert report.figures["failovers"] > 0 and report.figures["decode_failover_s"] > 0
    assert not simulation.world.replicas[1][0].alive
    steps_after = [end for end, _, _ in simulation.world.tally.step_times if end > 5.0]
    assert steps_after  # the run goes on with the other replica


def test_a_scenario_missing_a_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stages \[1\] have no training peer"):
        scenario(peers=tuple(p for p in peers() if p.name != "train1"))


def test_a_killed_training_peer_rolls_the_run_back_to_its_checkpoint() -> None:
    # Checkpoints every 3 steps; train1 dies at 27 s, mid-step, and is back at 42 s; a replica
    # is out at 20-30 s.
    kills = (Kill(20.0, "infer0.1", 10.0), Kill(27.0, "train1", 15.0))
    report, simulation = run(config=config(checkpoint_every=3), kills=kills, duration_s=240.0)
    world, tally = simulation.world, simulation.world.tally
    assert tally.kills == 2 and tally.rollbacks == 1
    assert 1 <= tally.steps_undone <= 3  # 3: it died saving the checkpoint of its step
    # The run goes on after it (once the replicas have the checkpoint's keyframe).
    assert any(end > 42.0 for end, _, _ in tally.step_times)
    # The versions agree again: the learner's is its steps, no peer is ahead of it.
    assert world.version == report.figures["steps"] == tally.steps_done > 0
    assert all(peer.version <= world.version for peer in world.peers())
    # The replica came back under its name and serves; the training peer too.
    assert [r.alive for r in world.replicas[0] if r.name == "infer0.1"] == [False, True]
    assert world.trainer(1) is not None
    # Nothing is lost: the undone steps' groups are pending again, trained again or dropped.
    groups = report.groups
    dropped = sum(count for reason, count in groups.items() if reason.startswith("dropped"))
    assert groups["produced"] == groups["trained"] + dropped + simulation.groups_pending()
    assert groups["trained"] == world.config.rollout.prompts_per_step * report.figures["steps"]
    assert sum(report.staleness.values()) == groups["trained"]


def test_a_kill_of_an_unknown_peer_is_refused() -> None:
    with pytest.raises(ValueError, match="a kill needs a known peer"):
        scenario(kills=(Kill(1.0, "nobody", 1.0),))


def test_the_run_ends_after_its_steps() -> None:
    report, simulation = run(config=config(steps=3), duration_s=600.0)
    assert report.figures["steps"] == 3
    ended = simulation.world.env.now
    assert ended == simulation.world.tally.step_times[-1][0] < 600.0


def test_on_a_shared_host_a_messages_software_work_takes_its_cores() -> None:
    """The loopback demo's processes share the host's cores: what a message costs beyond its
    bytes (encoding, signatures, the daemons) is CPU there, half at each end."""
    links = dataclasses.replace(LINKS, message_overhead_ms=4.0)
    on_host = tuple(dataclasses.replace(p, host="this") for p in peers())
    shared = CoordinatorSpec("eu", host="this")
    report, simulation = run(peers=on_host, coordinator=shared, links=links,
                             host_cores={"this": 2})
    endpoints = simulation.world.network.endpoints.values()
    messages = sum(e.messages for e in endpoints)
    assert messages > 0
    assert sum(e.cpu_s for e in endpoints) == pytest.approx(messages * 0.004)
    # Elsewhere the same work only delays the message.
    _, apart = run(links=links)
    assert sum(e.cpu_s for e in apart.world.network.endpoints.values()) == 0
    assert report.utilization["host this cores"] > 0
