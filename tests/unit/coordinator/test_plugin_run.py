"""A plug-in's task in the training loop: a tiny local run names the template's "count-letters"
(examples/plugin-template, made visible as tests/unit/envs/test_plugins.py does) in its config,
trains a step on it and evaluates on its held-out split."""

from __future__ import annotations

from pathlib import Path

from tests.unit.coordinator.test_dataset_run import tiny_task_run
from tests.unit.envs.test_plugins import site, template_plugin  # noqa: F401  (fixtures)


def test_a_run_trains_on_a_plugins_task(template_plugin: str,  # noqa: F811
                                        tiny_model_dir: Path, tmp_path: Path) -> None:
    tiny_task_run(tiny_model_dir, tmp_path,
                  {"name": "count-letters", "options": {"format_weight": 0.0}}, steps=1)
