"""The calibration's pieces that need no real model: what a demo's run folder measured, and the
coordinator's relaying timed with the real functions (sim/calibration.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decentrl.sim.calibration import (
    coordinator_costs,
    hop_overhead,
    measured_run,
    relay_seconds,
    sampling_seconds_per_logit,
)
from decentrl.sim.costs import StageCosts
from decentrl.sim.machines import HARDWARE
from decentrl.sim.scenario import Kill
from decentrl.sim.shapes import LLAMA_8B


def step(number: int, elapsed_s: float, **fields: float) -> dict[str, float]:
    return {"event": "step", "step": number, "version": number, "reward": 0.5, "accuracy": 0.5,
            "elapsed_s": elapsed_s, **fields}


def test_a_demo_run_folder_gives_the_figures_the_simulator_predicts(tmp_path: Path) -> None:
    # Training starts at 100 s (the first step waited 20 s and trained 10 s); a replica is killed
    # at 150 s and back at 180 s, a training peer killed at 200 s never comes back.
    records = [
        {"event": "swarm", "step": 0, "version": 0, "peers": []},
        step(1, 130.0, groups=8, staleness_mean=1.0, rows_stepped_per_s=100.0, wait_s=20.0,
             train_s=10.0, step_round_trip_s=0.5, generated_tokens=500.0),
        {"event": "chaos", "elapsed_s": 150.0, "peer": "infer0.1", "action": "killed"},
        {"event": "chaos", "elapsed_s": 180.0, "peer": "infer0.1", "action": "back"},
        step(2, 190.0, groups=24, staleness_mean=3.0, rows_stepped_per_s=200.0, wait_s=40.0,
             train_s=20.0, step_round_trip_s=0.3, generated_tokens=1200.0),
        {"event": "chaos", "elapsed_s": 200.0, "peer": "train1", "action": "killed"},
        {"event": "chaos", "elapsed_s": 230.0, "peer": "train1", "action": "not back",
         "detail": "timed out"}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    measured = measured_run(tmp_path)
    assert measured.figures == pytest.approx({
        "steps": 2.0, "staleness_mean": 2.5,  # weighted by groups
        "step_train_s": 15.0, "trained_tokens_per_s": 1200.0 / 60.0,
        "policy_rows_per_s": 150.0, "policy_round_trip_s": 0.4})
    assert measured.kills == (Kill(50.0, "infer0.1", 30.0), Kill(100.0, "train1", None))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    with pytest.raises(ValueError, match="has no step events"):
        measured_run(tmp_path)


def test_relaying_is_timed_with_the_real_functions() -> None:
    small, large = relay_seconds(4, 1, 32), relay_seconds(4, 64, 32)
    assert 0 < small and 0 < large
    per_message, per_byte = coordinator_costs(hidden=32)
    assert per_message >= 0 and per_byte >= 0


@pytest.mark.network
def test_a_hops_software_overhead_is_measured_between_two_real_nodes() -> None:
    fixed, per_byte = hop_overhead(rows=64, hidden=64, calls=2)
    assert fixed > 0 and per_byte >= 0


def test_sampling_is_the_last_stages_cpu_work_over_the_vocabulary() -> None:
    """The seeded noise is drawn on the CPU for every row over the whole vocabulary: on an 8B
    model's last stage, 152 rows cost what the per-logit figure says, whatever the GPU."""
    assert sampling_seconds_per_logit(rows=2, vocab=64) > 0
    gpu = HARDWARE["rtx-4090"]
    last = StageCosts(gpu, LLAMA_8B, 1, False, True, sampling_s_per_logit=1e-8)
    middle = StageCosts(gpu, LLAMA_8B, 1, False, False, sampling_s_per_logit=1e-8)
    assert last.sampling_s(152) == pytest.approx(152 * LLAMA_8B.vocab * 1e-8)
    assert middle.sampling_s(152) == 0
