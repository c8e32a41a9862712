"""The "dataset" task in the training loop: a tiny local run trains on the shipped word problems
(examples/datasets) and evaluates on their held-out split before and after, and the dataset
demo's recipe evaluates no more problems than its dataset holds out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarm_helpers import tiny_run_config

from decentrl.config import load_config, parse_config
from decentrl.coordinator.local_backend import local_run
from decentrl.demo import EXAMPLES_DIR, demo_config
from decentrl.tasks import make_task

WORD_PROBLEMS: dict[str, Any] = {"name": "dataset", "options": {
    "path": str(EXAMPLES_DIR / "datasets" / "word_problems.jsonl"), "checker": "numeric"}}


def tiny_task_run(model_dir: Path, run_dir: Path, task: dict[str, Any], steps: int) -> None:
    """A tiny local run trains `steps` steps on `task` and evaluates on 4 of its held-out
    problems before and after; checked to have recorded each."""
    config = tiny_run_config(
        model_dir, 2, name="tiny", host={"run_dir": str(run_dir), "threads": 1},
        task=task, rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"mode": "sync", "steps": steps, "micro_batch_size": 4,
               "zero_variance_groups": "keep"},
        eval={"task": task, "problems": 4, "pass_k": 2, "max_new_tokens": 4})
    summary = local_run(config).run()
    assert summary.steps == steps
    records = [json.loads(line)
               for line in (summary.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, steps + 1))
    assert [r["label"] for r in records if r["event"] == "eval"] == ["before", "after"]
    for name in ("eval_before.json", "eval_after.json"):
        result = json.loads((summary.path / name).read_text())
        assert result["task"] == task["name"] and result["problems"] == 4


def test_a_run_trains_and_evaluates_on_a_dataset(tiny_model_dir: Path, tmp_path: Path) -> None:
    tiny_task_run(tiny_model_dir, tmp_path, WORD_PROBLEMS, steps=2)


def test_the_dataset_recipes_evaluate_at_most_their_held_out_problems() -> None:
    demo, local = parse_config(demo_config("dataset")), load_config(EXAMPLES_DIR / "dataset.toml")
    assert local.task == demo.task and local.eval == demo.eval
    assert demo.task.name == demo.eval.task.name == "dataset"
    # The recipe's path is relative to the checkout, where the demo runs.
    options = {**demo.eval.task.options,
               "path": str(EXAMPLES_DIR.parent / demo.eval.task.options["path"])}
    task = make_task("dataset", **options)
    assert demo.eval.problems <= len(task.rows["heldout"])  # type: ignore[attr-defined]
