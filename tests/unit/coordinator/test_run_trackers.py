"""A whole local run with host.report_to naming every tracker: TensorBoard's event file, the W&B
offline run and the trackio run each read back the steps and evaluations of its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_helpers import tiny_run_config

from decentrl.coordinator.local_backend import local_run
from decentrl.observe.metrics import read_metrics
from tests.unit.observe.test_trackers import (
    assert_same_series,
    expected_series,
    offline_trackers,  # noqa: F401 (a fixture)
    tensorboard_series,
    trackio_series,
    wandb_series,
)


@pytest.mark.usefixtures("offline_trackers")
def test_a_run_reports_its_records_to_every_tracker(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_model_dir, 2, host={"run_dir": str(tmp_path), "threads": 1,
                                 "report_to": ["tensorboard", "wandb", "trackio"]},
        task={"name": "sums", "options": {"max_digits": 1}},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        train={"steps": 3, "micro_batch_size": 4, "mode": "sync",
               "zero_variance_groups": "keep"},
        eval={"problems": 4, "pass_k": 1, "max_new_tokens": 6})
    loop = local_run(config)
    try:
        summary = loop.run()
    finally:
        loop.close()
    records = read_metrics(summary.path / "metrics.jsonl")
    assert [r.step for r in records.steps] == [1, 2, 3]
    assert [(e.label, e.step) for e in records.evals] == [("before", 0), ("after", 3)]
    expected = expected_series([*records.steps, *records.evals])
    assert expected["train/reward"] == [(r.step, r.reward) for r in records.steps]
    assert expected["eval/pass1"] == [(e.step, e.pass1) for e in records.evals]
    assert_same_series(tensorboard_series(summary.path / "tensorboard"), expected)
    assert_same_series(wandb_series(summary.path / "wandb"), expected)
    assert_same_series(trackio_series(config.name), expected)
