"""The swarm coordinator end to end on loopback, with every peer a separate process: it trains,
survives a training peer dying mid-run, and a restarted coordinator resumes from SQLite with no
accepted rollout lost and no version skipped."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from swarm_helpers import launched_swarm, start_node, tiny_run_config

from decentrl.config import ConfigError, RunConfig, parse_config
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.swarm_backend import check_swarm_config, swarm_run
from decentrl.launch.join import READY
from decentrl.launch.local_swarm import Child, LocalSwarm
from decentrl.learn.checkpoints import CheckpointLayout
from decentrl.model.loading import model_spec
from decentrl.net.directory import SwarmUnavailable
from decentrl.net.link import LinkProfile, MessageLost
from decentrl.net.protocol import CHECKPOINT
from decentrl.net.training_messages import CheckpointRequest
from decentrl.net.wire import TensorLimits
from decentrl.observe.metrics import StepRecord, read_metrics
from decentrl.rollout.types import ScoredGroup


def swarm_config(model_dir: Path, run_dir: Path, steps: int) -> RunConfig:
    """Peers as processes over lightly emulated links, announcing often (a restarted peer must
    be found fast), checkpointing every second step. The rows in flight are sized by the
    coordinator: 16 groups at most (4 per step, 4 steps stale), two per session."""
    return tiny_run_config(
        model_dir, 2, codec="bf16", name="swarm",
        host={"run_dir": str(run_dir), "threads": 1,
              "link": {"rtt_ms": [10, 20], "jitter_ms": 2}},
        rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        train={"steps": steps, "micro_batch_size": 8, "checkpoint_every": 2,
               "zero_variance_groups": "keep", "max_staleness": 4, "lr": 1e-5},
        eval={"problems": 8, "pass_k": 1, "max_new_tokens": 6, "batch_size": 8},
        swarm={"announce_every_s": 0.5, "request_timeout_s": 20, "avoid_failed_peer_s": 5})


class Crash(RuntimeError):
    pass


@pytest.fixture
def swarm(tiny_model_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    config = swarm_config(tiny_model_dir, tmp_path / "runs", steps=6)
    with launched_swarm(config, replicas=1) as local:
        yield config, local


# ---- what the run store holds, read beside the coordinator ------------------------------------

@dataclass(frozen=True)
class StoredGroupState:
    state: str  # pending, trained or dropped
    step: int | None  # the step that trained it
    problem_index: int


@dataclass(frozen=True)
class StoreSnapshot:
    """One consistent read of a run store: its groups, steps and last checkpoint."""

    groups: dict[str, StoredGroupState]
    steps: list[tuple[int, int]]  # (step, version), in step order
    checkpoint: tuple[int, int] | None  # (version, step) of the last complete checkpoint

    def in_state(self, state: str) -> set[str]:
        return {gid for gid, group in self.groups.items() if group.state == state}

    def trained_after(self, step: int) -> set[str]:
        return {gid for gid, group in self.groups.items()
                if group.state == "trained" and group.step is not None and group.step > step}

    def trained_per_step(self) -> dict[int, int]:
        return dict(Counter(group.step for group in self.groups.values()
                            if group.state == "trained" and group.step is not None))


def read_store(path: Path) -> StoreSnapshot:
    """The store at `path`, read through a read-only connection in one transaction (the
    coordinator may be writing it meanwhile)."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)) as db:
        db.execute("BEGIN")
        groups = {gid: StoredGroupState(state, step, problem)
                  for gid, state, step, problem in db.execute(
                      "SELECT group_id, state, step, problem_index FROM groups")}
        steps = db.execute("SELECT step, version FROM steps ORDER BY step").fetchall()
        checkpoint = db.execute("SELECT version, step FROM checkpoints "
                                "ORDER BY version DESC LIMIT 1").fetchone()
        db.execute("COMMIT")
    return StoreSnapshot(groups, [tuple(row) for row in steps],
                         None if checkpoint is None else tuple(checkpoint))


def assert_nothing_lost(store: StoreSnapshot, steps: int, groups_per_step: int) -> None:
    """Every step recorded once with its own version (none skipped), each trained on a full
    batch, and no problem handed out twice."""
    assert store.steps == [(step, step) for step in range(1, steps + 1)]
    assert store.trained_per_step() == dict.fromkeys(range(1, steps + 1), groups_per_step)
    problems = [group.problem_index for group in store.groups.values()]
    assert len(problems) == len(set(problems))


# ---- a coordinator killed between accepting groups and training them --------------------------

class CrashWhileAccepting:
    """Kills the coordinator (an exception out of its run, no final save) right after its store
    committed the `crash_after`-th group accepted for the step after `step`, so that accepted
    groups wait in the store, pending, when it dies."""

    def __init__(self, loop: TrainingLoop, step: int, crash_after: int,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop, self.step, self.crash_after = loop, step, crash_after
        self.accepted: list[str] = []
        self.add_group = loop.store.add_group
        monkeypatch.setattr(loop.store, "add_group", self)

    def __call__(self, scored: ScoredGroup, staleness: int, learner_version: int) -> None:
        self.add_group(scored, staleness, learner_version)
        if self.loop.step == self.step:
            self.accepted.append(scored.group.group_id)
            if len(self.accepted) == self.crash_after:
                raise Crash(f"coordinator killed with {len(self.accepted)} groups of step "
                            f"{self.step + 1} accepted")


@pytest.mark.network
def test_coordinator_restart_resumes_from_sqlite(
        swarm, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    config, local = swarm
    database = config.path / "run.sqlite"
    first = swarm_run(config, local.bootstrap, Console(quiet=True))
    crash = CrashWhileAccepting(first, step=3, crash_after=2, monkeypatch=monkeypatch)
    try:
        with pytest.raises(Crash, match="killed with 2 groups of step 4 accepted"):
            first.run(wait_s=120)
    finally:
        first.close()
    before = read_store(database)
    assert before.steps == [(1, 1), (2, 2), (3, 3)]
    pending = before.in_state("pending")
    # Besides the two of step 4, groups accepted earlier may still wait: held for their check
    # while a step trained without them (coordinator/pool.py `held`). Together they may make a
    # full batch: the crash came inside the store's write, before step 4 could start.
    assert set(crash.accepted) <= pending
    trained = {gid: group for gid, group in before.groups.items() if group.state == "trained"}

    second = swarm_run(config, local.bootstrap, Console(quiet=True))
    try:
        summary = second.run(wait_s=120)
    finally:
        second.close()
    assert summary.steps == 6
    assert summary.before is None  # resumed, not restarted
    after = read_store(database)
    # The groups accepted before the crash were trained first thing after the restart (a batch
    # takes the pending pool first: step 4 is made of them, up to a full batch)...
    assert {gid: after.groups[gid].state for gid in pending} == dict.fromkeys(pending, "trained")
    steps_of_pending = [after.groups[gid].step for gid in pending]
    assert min(steps_of_pending) == 4
    assert steps_of_pending.count(4) == min(len(pending), config.rollout.prompts_per_step)
    # ... and the peers were at the store's version, so nothing trained before was undone.
    assert summary.recoveries == 0
    assert {gid: after.groups[gid] for gid in trained} == trained
    assert_nothing_lost(after, steps=6, groups_per_step=config.rollout.prompts_per_step)


# ---- a training peer killed mid-run -----------------------------------------------------------

@dataclass(frozen=True)
class Rollback:
    """What the coordinator had done when the first step after its recovery began."""

    loop_step: int
    recoveries: int
    trainer_versions: list[int]
    store: StoreSnapshot


class KillTrainingPeerAfterStep(RunHooks):
    """Once step `kill_after` is recorded, SIGKILLs a training peer and waits for its replacement
    (which loads the last checkpoint), on the loop's thread, so the next step is certain to meet
    the dead peer. Records the store as the kill left it, and the coordinator's state at the
    first step after its recovery."""

    def __init__(self, local: LocalSwarm, peer: str, kill_after: int, database: Path) -> None:
        self.local, self.peer, self.kill_after, self.database = local, peer, kill_after, database
        self.at_kill: StoreSnapshot | None = None
        self.after_rollback: Rollback | None = None

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        if self.at_kill is None and record.step == self.kill_after:
            self.at_kill = read_store(self.database)
            self.local.restart(self.peer)

    def before_step(self, loop: TrainingLoop) -> None:
        if self.after_rollback is None and loop.recoveries > 0:
            self.after_rollback = Rollback(loop.step, loop.recoveries,
                                           [worker.version for worker in loop.trainer.workers],
                                           read_store(self.database))


@pytest.mark.network
def test_training_peer_death_rolls_back_to_checkpoint(swarm) -> None:  # type: ignore[no-untyped-def]
    config, local = swarm
    database = config.path / "run.sqlite"
    # Step 3 is the first after the checkpoint of step 2 (checkpoint_every = 2).
    kill = KillTrainingPeerAfterStep(local, "train1", kill_after=3, database=database)
    coordinator = swarm_run(config, local.bootstrap, Console(quiet=True), hooks=[kill])
    try:
        summary = coordinator.run(wait_s=120)
    finally:
        coordinator.close()
    assert local.children["train1"].restarts == 1
    assert kill.at_kill is not None, "the run ended before the training peer was killed"
    assert kill.at_kill.checkpoint == (2, 2)  # (version, step)
    trained_since_checkpoint = kill.at_kill.trained_after(2)
    assert len(trained_since_checkpoint) == config.rollout.prompts_per_step

    # The step that met the dead peer failed, and the coordinator rolled every stage back to
    # the checkpoint: the peers at its version, the later step forgotten, its groups pending.
    rollback = kill.after_rollback
    assert rollback is not None, "the coordinator never recovered from the training peer's death"
    assert rollback.recoveries == 1
    assert rollback.loop_step == 2
    assert rollback.trainer_versions == [2] * config.num_stages
    assert rollback.store.steps == [(1, 1), (2, 2)]
    assert trained_since_checkpoint <= rollback.store.in_state("pending")

    assert summary.steps == 6
    assert summary.recoveries == 1
    # The coordinator sized its rows in flight from what it measured: whole sessions of two
    # groups, within the staleness bound, and the round trip and throughput it sized them by.
    records = read_metrics(config.path / "metrics.jsonl").steps
    session_rows = 2 * config.rollout.group_size
    assert all(r.rows_in_flight is not None and r.rows_in_flight % session_rows == 0
               and session_rows <= r.rows_in_flight <= 16 * config.rollout.group_size
               for r in records), [r.rows_in_flight for r in records]
    assert records[-1].step_round_trip_s is not None and records[-1].step_round_trip_s > 0
    assert records[-1].rows_stepped_per_s is not None and records[-1].rows_stepped_per_s > 0
    # The training peers measured their replicas' fidelity when they published, and the steps
    # recorded it per stage and over every stage.
    measured = [r for r in records if r.served_gap_by_stage is not None]
    assert measured, "no step recorded the replicas' fidelity"
    for record in measured:
        assert record.served_bf16_differing_by_stage is not None
        assert set(record.served_gap_by_stage) <= set(range(config.num_stages))
        assert record.served_gap is not None and record.served_gap >= 0
        assert record.served_bf16_differing is not None \
            and 0 <= record.served_bf16_differing <= 1
    after = read_store(database)
    assert {after.groups[gid].state for gid in trained_since_checkpoint} == {"trained"}
    assert_nothing_lost(after, steps=6, groups_per_step=config.rollout.prompts_per_step)


def test_swarm_refuses_what_it_cannot_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = swarm_config(tiny_model_dir, tmp_path, 1).model_dump()
    spec = model_spec(tiny_model_dir)
    for section, field, value, message in [("train", "kl_coef", 0.1, "kl_coef"),
                                           ("train", "mode", "sync", "async")]:
        data = {**base, section: {**base[section], field: value}}
        with pytest.raises(ConfigError, match=message):
            check_swarm_config(parse_config(data), spec)
    # Several optimizer steps per batch run in the swarm (a forward-only pass fixes the
    # proximal log-probs): nothing refuses them.
    check_swarm_config(parse_config({**base, "train": {
        **base["train"], "minibatches_per_batch": 2, "epochs_per_batch": 2}}), spec)
    layers = spec.num_layers
    too_many = rf"num_stages must be in \[1, {layers}\].*got {layers + 1}"
    with pytest.raises(ConfigError, match=too_many):
        check_swarm_config(parse_config({**base, "num_stages": layers + 1}), spec)


def test_sockets_a_peer_reports_after_it_is_ready_are_removed_when_it_is_killed(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """A key-rotating adversary starts a new daemon after its READY line and reports that
    daemon's sockets then: the launcher keeps reading, so a SIGKILL (which the daemon does not
    survive to clean up after) still leaves no socket behind."""
    config = tiny_run_config(tiny_model_dir, 2, host={"run_dir": str(tmp_path / "runs")})
    local = LocalSwarm(config, tmp_path / "config.json", replicas=1)
    first, later = tmp_path / "first.sock", tmp_path / "later.sock"
    first.touch()
    script = (f"import json, time\n"
              f"print(json.dumps({{'sockets': [{str(first)!r}]}}), flush=True)\n"
              f"print(json.dumps({{'ready': {READY!r}}}), flush=True)\n"
              f"open({str(later)!r}, 'w').close()\n"
              f"print(json.dumps({{'sockets': [{str(later)!r}]}}), flush=True)\n"
              f"time.sleep(600)\n")
    child = Child("rotating", [], tmp_path / "rotating.log")
    child.process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
    local.children[child.name] = child
    local._wait_ready(child, timeout_s=30)
    deadline = time.monotonic() + 30
    while str(later) not in local.sockets and time.monotonic() < deadline:
        time.sleep(0.05)
    assert str(later) in local.sockets
    local.kill(child.name)
    assert child.process.poll() is not None
    assert not later.exists() and not local.sockets


@pytest.mark.network
def test_a_checkpoint_that_cannot_be_saved_costs_that_checkpoint_only(swarm) -> None:  # type: ignore[no-untyped-def]
    """A periodic save that fails (a training peer too slow to answer: under memory pressure a
    demo's coordinator once died of it) is reported and skipped: `latest` stays at the last
    complete checkpoint, the run goes on, and the final save is made."""
    config, local = swarm
    coordinator = swarm_run(config, local.bootstrap, Console(quiet=True))
    save = coordinator.backend.save_checkpoint
    failed: list[int] = []

    def slow_peer(version: int, step: int, problem_position: int) -> None:
        if step == 2:
            failed.append(version)
            raise SwarmUnavailable("training stage 1: checkpoint at train1: no answer within 30s")
        save(version, step, problem_position)

    coordinator.backend.save_checkpoint = slow_peer  # type: ignore[method-assign]
    try:
        summary = coordinator.run(wait_s=120)
    finally:
        coordinator.close()
    assert failed == [2] and summary.steps == 6
    with closing(sqlite3.connect(config.path / "run.sqlite")) as db:
        saved = [v for (v,) in db.execute("SELECT version FROM checkpoints ORDER BY version")]
    assert saved == [0, 4, 6]
    assert CheckpointLayout(config.path / "checkpoints").latest_version() == 6


@pytest.mark.network
def test_a_call_its_own_loop_never_runs_is_a_lost_message(tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop of `call_sync` (the call's own timeout did not fire: the node's event loop
    was starved) raises what every caller already handles, a lost message, not a bare
    TimeoutError out of the training loop."""
    config = tiny_run_config(tiny_model_dir, 2)
    node = start_node(config, "starved", [], TensorLimits(), LinkProfile())
    try:
        async def never_answers(*args: Any) -> None:
            await asyncio.sleep(3600)

        monkeypatch.setattr(node.calls, "call", never_answers)
        with pytest.raises(MessageLost, match="no answer within 10s"):
            node.call_sync("12D3KooWpeer", CHECKPOINT, CheckpointRequest(action="save", version=1),
                           timeout=0.0)
    finally:
        node.shutdown()
