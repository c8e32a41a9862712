"""The run store: what is committed survives a crash (reopen without close, and a process killed
mid-run), problem positions never repeat, group states move only from pending, steps are
consecutive, and bad files or configs fail with errors that name the problem."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from decentrl.coordinator.store import SCHEMA_VERSION, DuplicateGroup, RunStore, StoreError
from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup, VersionSpan


def scored(group_id: str, problem_index: int = 0) -> ScoredGroup:
    rollouts = [Rollout(prompt_tokens=[1, 2, 3], completion_tokens=[4, 5 + i],
                        behaviour_logprobs=[-0.5, -1.25 - i], finished=i % 2 == 0)
                for i in range(2)]
    # Stage 0 moved from version 3 to 4 after the first token.
    spans = [VersionSpan(start=0, versions=[3, 2]), VersionSpan(start=1, versions=[4, 2])]
    group = RolloutGroup(group_id=group_id, task="arith", problem_index=problem_index,
                         stage_versions=[3, 2], version_spans=spans, sampling_seed=7,
                         rollouts=rollouts)
    return ScoredGroup(group=group, rewards=[1.0, 0.0], correct=[1.0, 0.0])


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "state.sqlite"  # the parent folder does not exist yet


# ------------------------------------------------------------------------------ durability

def test_reopen_without_close_keeps_everything(path: Path) -> None:
    first = RunStore(path)  # never closed: a crashed coordinator
    first.check_or_set_config('{"lr": 1e-6}')
    first.set_meta("note", "hello")
    assert first.reserve_problems(3) == [0, 1, 2]
    for i in range(3):
        first.add_group(scored(f"g{i}", problem_index=i), staleness=i, learner_version=5)
    first.mark_trained(["g0"], step=1)
    first.mark_dropped(["g1"], reason="too stale")
    first.record_step(1, version=6, metrics={"loss": 0.25, "reward": 0.5})
    first.record_checkpoint(version=6, step=1, stages=2)

    second = RunStore(path)
    assert second.problem_position() == 3
    assert second.get_meta("note") == "hello"
    second.check_or_set_config('{"lr": 1e-6}')
    assert second.counts() == {"pending": 1, "trained": 1, "dropped": 1}
    [pending] = second.pending_groups()
    assert pending.group_id == "g2"
    assert pending.scored == scored("g2", problem_index=2)
    assert (pending.staleness, pending.learner_version) == (2, 5)
    assert (second.last_step(), second.last_version()) == (1, 6)
    assert second.last_checkpoint() == (6, 1)
    assert all(second.is_known(g) for g in ("g0", "g1", "g2")) and not second.is_known("g3")
    second.close()
    first.close()
    with RunStore(path) as third:
        assert third.reserve_problems(2) == [3, 4]
    with pytest.raises(StoreError, match="closed"):
        third.last_step()


def test_killed_process_loses_nothing_committed(path: Path) -> None:
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_store import scored\n"
        "from decentrl.coordinator.store import RunStore\n"
        "store = RunStore(Path(sys.argv[1]))\n"
        "store.reserve_problems(4)\n"
        "store.add_group(scored('killed'), staleness=1, learner_version=2)\n"
        "os._exit(9)  # no close, no cleanup\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    with RunStore(path) as store:
        assert store.problem_position() == 4
        assert [g.group_id for g in store.pending_groups()] == ["killed"]


def test_reserved_problems_never_repeat_across_reopen(path: Path) -> None:
    handed_out: list[int] = []
    for count in (2, 0, 5, 1):
        store = RunStore(path)
        handed_out += store.reserve_problems(count)
        store.close()
    assert handed_out == list(range(8))
    with RunStore(path) as store, pytest.raises(ValueError, match="-1"):
        store.reserve_problems(-1)


def test_threads_adding_groups_all_land(path: Path) -> None:
    errors: list[BaseException] = []

    def add(worker: int) -> None:
        try:
            for i in range(25):
                store.add_group(scored(f"w{worker}-{i}"), staleness=0, learner_version=0)
                store.reserve_problems(1)
        except BaseException as error:  # surfaced below: a thread's exception is otherwise lost
            errors.append(error)

    with RunStore(path) as store:
        threads = [threading.Thread(target=add, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert store.counts()["pending"] == 100
        assert store.problem_position() == 100
        ids = [g.group_id for g in store.pending_groups()]
        assert len(set(ids)) == 100
        for w in range(4):  # acceptance order is kept within each thread
            mine = [g for g in ids if g.startswith(f"w{w}-")]
            assert mine == [f"w{w}-{i}" for i in range(25)]


# ---------------------------------------------------------------------------------- groups

def test_duplicate_group_is_rejected_and_changes_nothing(path: Path) -> None:
    with RunStore(path) as store:
        store.add_group(scored("g", problem_index=1), staleness=0, learner_version=1)
        with pytest.raises(DuplicateGroup, match="group g is already stored"):
            store.add_group(scored("g", problem_index=9), staleness=4, learner_version=8)
        [stored] = store.pending_groups()
        assert stored.scored.group.problem_index == 1
        assert (stored.staleness, stored.learner_version) == (0, 1)
        assert store.counts() == {"pending": 1, "trained": 0, "dropped": 0}


def test_pending_trained_and_back(path: Path) -> None:
    with RunStore(path) as store:
        for i in range(5):
            store.add_group(scored(f"g{i}"), staleness=0, learner_version=0)
        store.mark_trained(["g0", "g1"], step=1)
        store.record_step(1, version=1, metrics={})
        store.mark_trained(["g2"], step=2)
        store.record_step(2, version=2, metrics={})
        store.record_checkpoint(version=2, step=2, stages=1)
        store.mark_trained(["g3"], step=3)
        store.record_step(3, version=3, metrics={})
        store.record_checkpoint(version=3, step=3, stages=1)
        assert [g.group_id for g in store.pending_groups()] == ["g4"]

        # Training rolls back to step 1: steps 2 and 3 are redone with their groups.
        assert store.return_to_pending(after_step=1) == 2
        assert [g.group_id for g in store.pending_groups()] == ["g2", "g3", "g4"]
        assert store.counts() == {"pending": 3, "trained": 2, "dropped": 0}
        assert (store.last_step(), store.last_version()) == (1, 1)
        assert store.last_checkpoint() is None
        store.record_step(2, version=2, metrics={})
        assert store.return_to_pending(after_step=2) == 0


def test_only_pending_groups_change_state(path: Path) -> None:
    with RunStore(path) as store:
        store.add_group(scored("a"), staleness=0, learner_version=0)
        store.add_group(scored("b"), staleness=0, learner_version=0)
        store.mark_trained(["a"], step=1)
        with pytest.raises(ValueError, match="group a is trained"):
            store.mark_trained(["a"], step=2)
        with pytest.raises(ValueError, match="group a is trained"):
            store.mark_dropped(["b", "a"], reason="x")  # all or nothing: b stays pending
        with pytest.raises(ValueError, match="group nope is not stored"):
            store.mark_trained(["nope"], step=2)
        assert [g.group_id for g in store.pending_groups()] == ["b"]
        store.mark_dropped(["b"], reason="stale")
        with pytest.raises(ValueError, match="group b is dropped"):
            store.mark_trained(["b"], step=2)
        assert store.counts() == {"pending": 0, "trained": 1, "dropped": 1}


def test_corrupt_group_payload_names_the_group(path: Path) -> None:
    with RunStore(path) as store:
        store.add_group(scored("bad"), staleness=0, learner_version=0)
    # A payload of the wrong shape: strict decoding must refuse it, not return a half object.
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE groups SET payload = ? WHERE group_id = 'bad'",
                   (msgspec.msgpack.encode({"group": {"group_id": "bad"}, "rewards": "x"}),))
    db.close()
    with RunStore(path) as store, pytest.raises(StoreError, match="group bad does not decode"):
        store.pending_groups()


# ----------------------------------------------------------------------- steps and versions

def test_steps_must_be_consecutive(path: Path) -> None:
    with RunStore(path) as store:
        assert (store.last_step(), store.last_version()) == (0, 0)
        with pytest.raises(ValueError, match="the next must be 1"):
            store.record_step(2, version=1, metrics={})
        store.record_step(1, version=1, metrics={"loss": 1.0})
        with pytest.raises(ValueError, match="the last recorded step is 1"):
            store.record_step(1, version=1, metrics={})
        with pytest.raises(ValueError, match="the next must be 2"):
            store.record_step(3, version=3, metrics={})
        store.record_step(2, version=2, metrics={"loss": 0.5})
        assert (store.last_step(), store.last_version()) == (2, 2)


def test_checkpoint_round_trip(path: Path) -> None:
    with RunStore(path) as store:
        assert store.last_checkpoint() is None
        store.record_checkpoint(version=0, step=0, stages=3)  # the initial weights
        for step in (1, 2):
            store.record_step(step, version=step, metrics={})
        store.record_checkpoint(version=2, step=2, stages=3)
        with pytest.raises(ValueError, match="record the step before its checkpoint"):
            store.record_checkpoint(version=5, step=5, stages=3)
        with pytest.raises(ValueError, match="at least one stage"):
            store.record_checkpoint(version=2, step=2, stages=0)
    with RunStore(path) as store:
        assert store.last_checkpoint() == (2, 2)


# ------------------------------------------------------------------------ config and files

def test_config_mismatch_is_described(path: Path) -> None:
    config = {"train": {"lr": 1e-6, "steps": 100}, "seed": 1}
    with RunStore(path) as store:
        store.check_or_set_config(json.dumps(config))
        # Same config, other key order and spacing: accepted.
        store.check_or_set_config(json.dumps(config, indent=2, sort_keys=True))
        changed = {"train": {"lr": 2e-6, "steps": 100}, "seed": 1, "task": "arith"}
        with pytest.raises(ValueError, match=r"task: not stored, given \"arith\"; "
                                             r"train\.lr: stored 1e-06, given 2e-06$"):
            store.check_or_set_config(json.dumps(changed))
        assert json.loads(store.get_meta("config") or "") == config


def test_a_resumed_run_may_change_only_what_may_change(path: Path) -> None:
    config = {"train": {"lr": 1e-6, "steps": 100}, "seed": 1}
    longer = {"train": {"lr": 1e-6, "steps": 200}, "seed": 1}
    with RunStore(path) as store:
        store.check_or_set_config(json.dumps(config))
        store.check_or_set_config(json.dumps(longer), may_change=("train.steps",))
        assert json.loads(store.get_meta("config") or "") == longer  # the new length is kept
        other_seed = {"train": {"lr": 1e-6, "steps": 300}, "seed": 2}
        with pytest.raises(ValueError, match=r"seed: stored 1, given 2$"):
            store.check_or_set_config(json.dumps(other_seed), may_change=("train.steps",))
        assert json.loads(store.get_meta("config") or "") == longer


def test_garbage_file_and_directory_are_refused(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database, it is just some bytes" * 100)
    with pytest.raises(StoreError, match="garbage.sqlite is not a usable SQLite database"):
        RunStore(garbage)
    with pytest.raises(StoreError, match=f"{tmp_path} is a directory"):
        RunStore(tmp_path)


def store_with_schema(path: Path, version: int) -> Path:
    """A run store at `path` whose schema version then says `version`."""
    RunStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {version}")
    db.commit()
    db.close()
    return path


def test_foreign_newer_or_older_database_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE users (name TEXT)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="not a run store"):
        RunStore(other)

    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}"):
        RunStore(store_with_schema(tmp_path / "newer.sqlite", SCHEMA_VERSION + 1))
    with pytest.raises(StoreError, match="older decentrl .*start a new run"):
        RunStore(store_with_schema(tmp_path / "older.sqlite", SCHEMA_VERSION - 1))
