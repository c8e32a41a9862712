"""`decentrl train` on every registered family's tiny model (its conformance case,
tests/unit/model/families/cases.py): two optimizer steps in one process, with two stages, from
the command line to the exported model; and with a tokenizer that has no pad token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swarm_helpers import tiny_run_config
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.config import RUN_MODEL_DIR
from decentrl.coordinator.local_backend import local_run
from decentrl.coordinator.store import RunStore
from decentrl.model.loading import model_spec
from decentrl.model.tiny import make_tiny_model
from tests.unit.model.families.cases import family_cases
from tests.unit.model.families.conformance import FamilyCase
from tests.unit.model.families.test_qwen3_moe import CASES as qwen3_moe_cases

# `decentrl train` configures logging into its run folder; each test puts it back.
pytestmark = pytest.mark.usefixtures("restored_logging")

RUN = """
name = "{name}"
model = "{model}"
num_stages = 2

[host]
run_dir = "{run_dir}"
device = "cpu"
dtype = "fp32"
threads = 1

[task]
name = "sums"
options = {{ max_digits = 1 }}

[rollout]
group_size = 2
prompts_per_step = 2
max_new_tokens = 4

[train]
steps = 2
micro_batch_size = 4
zero_variance_groups = "keep"
lr = 1e-3

[eval]
problems = 2
pass_k = 1
max_new_tokens = 4
greedy = false
"""


def train_two_steps(model: Path, tmp_path: Path, name: str) -> Path:
    """`decentrl train` of `model` for two steps; the run's folder."""
    config = tmp_path / "run.toml"
    config.write_text(RUN.format(name=name, model=model, run_dir=tmp_path / "runs"))
    result = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if record["event"] == "step"]
    assert [(r["step"], r["version"]) for r in steps] == [(1, 1), (2, 2)]
    return run


@pytest.mark.parametrize("case", family_cases(), ids=str)
def test_two_training_steps_of_every_family(case: FamilyCase, tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", seed=1, model_type=case.model_type,
                            **case.config)
    run = train_two_steps(model, tmp_path, "two-steps")
    exported = json.loads((run / RUN_MODEL_DIR / "config.json").read_text())
    assert exported["model_type"] == case.model_type


def test_two_training_steps_with_a_tokenizer_without_a_pad_token(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model", seed=1)
    path = model / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    del tokenizer_config["pad_token"]
    path.write_text(json.dumps(tokenizer_config))
    train_two_steps(model, tmp_path, "no-pad")


def test_train_runs_with_routing_replay(tmp_path: Path) -> None:
    """`decentrl train` in one process on the tiny Qwen3-MoE, recording each completion token's
    experts in generation and replaying them in the learner: two steps."""
    (case,) = qwen3_moe_cases
    folder = make_tiny_model(tmp_path / "model", seed=1, model_type=case.model_type,
                             **case.config)
    config = tiny_run_config(
        folder, 2, name="moe", host={"run_dir": str(tmp_path), "threads": 1},
        task={"name": "sums", "options": {"max_digits": 1}},
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        train={"steps": 2, "micro_batch_size": 4, "mode": "sync", "routing_replay": True,
               "zero_variance_groups": "keep"},
        eval={"problems": 4, "pass_k": 2, "max_new_tokens": 6})
    summary = local_run(config).run()
    assert summary.steps == 2
    store = RunStore(summary.path / "run.sqlite")
    rollouts = [r for scored in store.accepted_groups() for r in scored.group.rollouts]
    store.close()
    assert rollouts and all(r.routing is not None for r in rollouts)
    spec = model_spec(folder)
    assert spec.moe is not None
    assert all((r.routing.layers, r.routing.top_k) == (len(spec.sparse_layers), spec.moe.top_k)
               for r in rollouts if r.routing is not None)
