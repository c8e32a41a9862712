"""A swarm across the small internet of net/netns.py: the coordinator and a relay on the public
segment, more than half the stage peers behind two home NATs (an inference replica and the
training peer of stage 0 in different homes, so stage 0's weight updates cross two NATs). It
generates and trains exactly as the same swarm on loopback, its replicas take every update, and
it survives its relay's death mid-run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.backend import RunSummary
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.launch.local_swarm import LocalSwarm
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.net.netns import HomeSpec, Internet
from decentrl.net.protocol import PeerRecord
from decentrl.observe.metrics import StepRecord
from decentrl.release.export import export_run
from tests.netns.test_netns import netns_or_skip

STEPS = 3
PLACEMENT = {"coordinator": "coordinator", "train0": "home1a", "infer0.0": "home2a",
             "train1": "public1", "infer1.0": "home1b"}
BEHIND_NAT = ("train0", "infer0.0", "infer1.0")


def json_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def run_config(model_dir: Path, run_dir: Path) -> RunConfig:
    # One session at a time and no spot-checks: the first step's batch is the same groups in
    # both swarms, so its numbers can be compared.
    return tiny_run_config(
        model_dir, 2, host={"run_dir": str(run_dir)},
        rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        train={"steps": STEPS, "micro_batch_size": 8, "zero_variance_groups": "keep",
               "max_staleness": 4},
        eval={"problems": 8, "pass_k": 1, "max_new_tokens": 6, "batch_size": 8},
        swarm={"announce_every_s": 1.0, "sessions_in_flight": 1, "request_timeout_s": 20},
        trust={"verify_fraction": 0.0, "train_audit_fraction": 0.0})


class KillRelayOnceUsed(RunHooks):
    """After step 2, once stage 0's replica holds an update (which came through the relay),
    kills the relay."""

    def __init__(self, local: LocalSwarm) -> None:
        self.local, self.killed = local, False

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        if record.step != 2 or self.killed:
            return
        directory = loop.backend.chain.directory  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                r.version >= 1 for r in directory.stage_summary()[0] if r.role == "inference"):
            time.sleep(0.5)
            directory.refresh()
        self.local.kill("relay0")
        self.killed = True


def run_swarm(config: RunConfig, **where: Any) -> tuple[RunSummary, list[StepRecord],
                                                          dict[str, PeerRecord], LocalSwarm]:
    """The run's summary, its step records, and each peer's last announcement."""
    config.path.mkdir(parents=True)
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json())
    local = LocalSwarm(config, config_path, replicas=1, **where)
    try:
        local.start()
        # The relay dies once stage 0's first update went through it.
        hooks: list[RunHooks] = [KillRelayOnceUsed(local)] if "relays" in where else []
        coordinator = swarm_run(config, local.bootstrap, Console(quiet=True), hooks)
        records: list[StepRecord] = []

        class Record(RunHooks):
            def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
                records.append(record)
        coordinator.hooks.append(Record())
        try:
            summary = coordinator.run(wait_s=180)
            directory = coordinator.backend.chain.directory
            directory.refresh()
            peers = {r.name: r for stage in directory.stage_summary() for r in stage}
        finally:
            coordinator.close()
    finally:
        local.shutdown()
    assert not local.sockets, f"leftover p2pd sockets: {local.sockets}"
    return summary, records, peers, local


@pytest.mark.network
@pytest.mark.slow
def test_a_swarm_half_behind_nat_matches_the_loopback_one_and_survives_its_relay(
        tiny_sharp_dir: Path, tmp_path: Path) -> None:
    netns_or_skip()
    loopback, loop_records, _, _ = run_swarm(run_config(tiny_sharp_dir, tmp_path / "loopback"))
    with Internet.start(["coordinator", "relay", "public1"],
                        [HomeSpec(["home1a", "home1b"]), HomeSpec(["home2a"])]) as internet:
        far, far_records, peers, local = run_swarm(
            run_config(tiny_sharp_dir, tmp_path / "netns"), internet=internet,
            placement=PLACEMENT, relays=["relay"])
    # Who could be dialed how, as each peer found out and said.
    said = {name: child.info.get("reachability", "") for name, child in local.children.items()}
    for name in BEHIND_NAT:
        assert said[name].startswith("reachable through relay"), (name, said[name])
    assert said["train1"].startswith("reachable directly"), said["train1"]
    # Generation, token for token: the evaluation before training (greedy and sampled).
    assert loopback.before is not None and far.before is not None
    assert [s["completion"] for s in far.before.samples] == \
        [s["completion"] for s in loopback.before.samples]
    assert far.before.pass1 == loopback.before.pass1
    # The first step trained on the same groups to the same numbers.
    first, first_far = loop_records[0], far_records[0]
    assert (first_far.policy_loss, first_far.grad_norm, first_far.reward) == \
        (first.policy_loss, first.grad_norm, first.reward)
    # Every step done, though the relay died after the second, and every replica behind NAT
    # took every update of its training peer behind another NAT: stage 0's replica reached its
    # training peer through the relay first, then, with the relay gone, through the coordinator.
    assert far.steps == STEPS
    versions = {name: peer.version for name, peer in peers.items() if peer.role == "inference"}
    assert versions == {"infer0.0": STEPS, "infer1.0": STEPS}, versions
    # Stage 0's training peer answered its replica through relays; the public one never.
    assert peers["train0"].bytes_relayed > 0 and peers["train1"].bytes_relayed == 0
    # Nothing assumed a shared disk: each training peer wrote its shards to a folder of its own,
    # the coordinator fetched the last checkpoint's over the swarm, and the release is made
    # from the run folder alone.
    layout = CheckpointLayout(far.path / "checkpoints")
    version = layout.latest_version()
    assert version == STEPS
    for stage, name in enumerate(("train0", "train1")):
        own = CheckpointLayout(far.path / "hosts" / name / "checkpoints").stage_file(version,
                                                                                    stage)
        assert layout.stage_file(version, stage).read_bytes() == own.read_bytes()
    assert (export_run(far.path, far.path / "model") / "model.safetensors").is_file()
    assert local.bootstrap is not None
    relay, coordinator = local.children["relay0"].info["peer_id"], local.bootstrap.peer_id
    train0 = local.children["train0"].info["peer_id"]
    routes = [line["message"] for line in json_log(local.children["infer0.0"].log_path)
              if f"connected to {train0[-8:]} through" in line["message"]]
    # A relayed connection is renewed when its circuit's limits run out, so the relay may carry
    # several connections before it dies; every later one goes through the coordinator.
    relayed = [relay in route for route in routes]
    assert relayed[0] and not relayed[-1] and relayed == sorted(relayed, reverse=True), routes
    assert all(coordinator in route for route, by_relay in zip(routes, relayed) if not by_relay)
