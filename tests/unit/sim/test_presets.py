"""The scenarios of the runs measured on this host (sim/presets.py), run small: the operator's
walk in network namespaces ends after its steps with its NAT'd pairs relayed, and the chaos demo
meets the kills it is given."""

from __future__ import annotations

from decentrl.config import RunConfig
from decentrl.sim.machines import HARDWARE
from decentrl.sim.presets import HostCalibration, chaos_demo, operator_swarm
from decentrl.sim.run import Simulation, simulate
from decentrl.sim.scenario import Kill, Scenario
from decentrl.sim.shapes import ModelShape

TINY = ModelShape(name="tiny", layers=8, hidden=64, intermediate=128, heads=4, kv_heads=2,
                  head_dim=16, vocab=512, tied_embeddings=True)
HOST = HostCalibration(HARDWARE["ryzen-9-7950x"], cores=2, hop_overhead=(0.007, 1e-9))


def config(stages: int, **train: int) -> RunConfig:
    return RunConfig.model_validate({
        "name": "preset", "num_stages": stages,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        "train": {"micro_batch_size": 8, **train}})


def test_the_operator_walk_ends_after_its_steps_with_its_nat_pairs_relayed() -> None:
    scenario = operator_swarm(config(4, steps=3), TINY, HOST)
    assert sorted(p.name for p in scenario.peers) == sorted(
        [*(f"train{s}" for s in range(4)), *(f"infer{s}" for s in range(4))])
    assert all(p.behind_nat for p in scenario.peers)
    report = simulate(scenario)
    assert report.figures["steps"] == 3
    # Weight updates go from each training peer to its replica, both behind NAT: relayed.
    assert report.figures["relayed_mb"] > 0
    # Every process shares the host's cores, messages' software work included.
    assert 0 < report.utilization["host this cores"] <= 1


def test_the_chaos_demo_meets_the_kills_it_is_given() -> None:
    kills = (Kill(30.0, "infer1.1", 20.0), Kill(120.0, "train0", 25.0))
    scenario = chaos_demo(config(2, checkpoint_every=5), HOST, kills)
    assert scenario.kills == kills
    report = simulate(scenario)
    assert report.figures["kills"] == 2
    assert report.figures["rollbacks"] <= 1 and report.figures["steps"] > 0
    # The restarts' own work (imports, loading a stage) took a core of the host meanwhile.
    assert simulate_restarts(scenario) == 20.0 + 25.0


def simulate_restarts(scenario: Scenario) -> float:
    simulation = Simulation(scenario)
    simulation.run()
    return simulation.world.restart_cpu_s["this"]


def test_a_peer_that_did_not_come_back_stays_out_and_takes_no_core() -> None:
    kills = (Kill(30.0, "infer1.1", None),)
    simulation = Simulation(chaos_demo(config(2), HOST, kills))
    report = simulation.run()
    assert report.figures["kills"] == 1
    assert [r.alive for r in simulation.world.replicas[1] if r.name == "infer1.1"] == [False]
    assert simulation.world.restart_cpu_s["this"] == 0
