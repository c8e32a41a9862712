"""A plug-in's task in the training loop: a tiny local run names the template's "count-letters"
(examples/plugin-template, made visible as tests/unit/envs/test_plugins.py does) in its config,
trains a step on it and evaluates on its held-out split."""

from __future__ import annotations

import json
from pathlib import Path

from swarm_helpers import tiny_run_config

from decentrl.coordinator.local_backend import local_run
from tests.unit.envs.test_plugins import site, template_plugin  # noqa: F401  (fixtures)

COUNT_LETTERS = {"name": "count-letters", "options": {"format_weight": 0.0}}


def test_a_run_trains_on_a_plugins_task(template_plugin: str,  # noqa: F811
                                        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_model_dir, 2, name="plugin", host={"run_dir": str(tmp_path), "threads": 1},
        task=COUNT_LETTERS, rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"mode": "sync", "steps": 1, "micro_batch_size": 4, "zero_variance_groups": "keep"},
        eval={"task": COUNT_LETTERS, "problems": 2, "pass_k": 2, "max_new_tokens": 4})
    summary = local_run(config).run()
    assert summary.steps == 1
    records = [json.loads(line)
               for line in (summary.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == [1]
    result = json.loads((summary.path / "eval_after.json").read_text())
    assert result["task"] == "count-letters" and result["problems"] == 2
