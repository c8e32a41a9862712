"""The swarm coordinator end to end on loopback, with every peer a separate process: it trains,
survives a training peer dying mid-run, and a restarted coordinator resumes from SQLite with no
accepted rollout lost and no version skipped."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from swarm_helpers import launched_swarm

from decentrl.config import ConfigError, RunConfig, parse_config
from decentrl.model.blocks import ModelSpec
from decentrl.swarm.coordinate import SwarmCoordinator, check_swarm_config
from decentrl.swarm.store import RunStore


def swarm_config(model_dir: Path, run_dir: Path, steps: int) -> RunConfig:
    return parse_config({
        "name": "swarm", "run_dir": str(run_dir), "model": str(model_dir), "num_stages": 2,
        "device": "cpu", "dtype": "fp32", "threads": 1,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        "train": {"steps": steps, "micro_batch_size": 8, "checkpoint_every": 2,
                  "zero_variance_groups": "keep", "max_staleness": 4},
        "eval": {"problems": 8, "pass_k": 1, "max_new_tokens": 6, "batch_size": 8},
        "swarm": {"link": {"rtt_ms": [10, 20], "jitter_ms": 2}, "announce_every_s": 0.5,
                  "sessions_in_flight": 2, "request_timeout_s": 20, "ban_s": 5},
    })


class Crash(RuntimeError):
    pass


class CrashingCoordinator(SwarmCoordinator):
    """Dies right after recording step `crash_after`, like a killed process (no final save)."""

    crash_after = 0

    def _train_one_step(self, metrics):  # type: ignore[no-untyped-def]
        super()._train_one_step(metrics)
        if self.step == self.crash_after:
            raise Crash(f"coordinator killed after step {self.step}")


@pytest.fixture
def swarm(tiny_model_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    config = swarm_config(tiny_model_dir, tmp_path / "runs", steps=6)
    with launched_swarm(config, replicas=1) as local:
        yield config, local


def assert_nothing_lost(store: RunStore, steps: int) -> None:
    counts = store.counts()
    assert store.last_step() == steps
    assert store.last_version() == steps  # one version per step, none skipped
    assert counts["trained"] >= steps * 4  # prompts_per_step groups per step
    assert counts["pending"] + counts["trained"] + counts["dropped"] == sum(counts.values())


def test_coordinator_restart_resumes_from_sqlite(swarm) -> None:  # type: ignore[no-untyped-def]
    config, local = swarm
    first = CrashingCoordinator(config, local.bootstrap, Console(quiet=True))
    first.crash_after = 3
    with pytest.raises(Crash):
        first.run(wait_s=120)
    first.close()
    with RunStore(config.path / "run.sqlite") as store:
        assert store.last_step() == 3
        accepted_before = sum(store.counts().values())
    second = SwarmCoordinator(config, local.bootstrap, Console(quiet=True))
    summary = second.run(wait_s=120)
    second.close()
    assert summary.steps == 6
    assert summary.before is None  # resumed, not restarted
    with RunStore(config.path / "run.sqlite") as store:
        assert_nothing_lost(store, 6)
        assert sum(store.counts().values()) >= accepted_before


def test_training_peer_death_rolls_back_to_checkpoint(swarm) -> None:  # type: ignore[no-untyped-def]
    config, local = swarm
    coordinator = SwarmCoordinator(config, local.bootstrap, Console(quiet=True))
    killed = threading.Event()
    restart_errors: list[BaseException] = []

    def kill_after_step_three() -> None:
        while coordinator.step < 3 and not coordinator.stop.is_set():
            time.sleep(0.05)
        try:
            local.restart("train1")  # SIGKILL, then a fresh process that loads the checkpoint
            killed.set()
        except BaseException as error:  # the replacement failed: stop the run, fail the test
            restart_errors.append(error)
            coordinator.stop.set()

    threading.Thread(target=kill_after_step_three, daemon=True).start()
    try:
        summary = coordinator.run(wait_s=120)
    finally:
        coordinator.close()
    assert not restart_errors, f"the replacement training peer failed: {restart_errors}"
    assert killed.is_set()
    assert summary.steps == 6
    assert summary.recoveries >= 1
    assert local.children["train1"].restarts == 1
    with RunStore(config.path / "run.sqlite") as store:
        assert_nothing_lost(store, 6)


def test_swarm_refuses_what_it_cannot_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = swarm_config(tiny_model_dir, tmp_path, 1).model_dump()
    spec = ModelSpec.from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    for section, field, value, message in [("train", "kl_coef", 0.1, "kl_coef"),
                                           ("train", "updates_per_batch", 2, "updates_per_batch"),
                                           ("train", "mode", "sync", "async")]:
        data = {**base, section: {**base[section], field: value}}
        with pytest.raises(ConfigError, match=message):
            check_swarm_config(parse_config(data), spec)
    layers = spec.num_layers
    too_many = rf"num_stages must be in \[1, {layers}\].*got {layers + 1}"
    with pytest.raises(ConfigError, match=too_many):
        check_swarm_config(parse_config({**base, "num_stages": layers + 1}), spec)
