"""Stage plans that follow the peers (model/planner.py) and runs on uneven plans."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from decentrl.cli import app
from decentrl.config import parse_config
from decentrl.model.loading import load_model, model_spec
from decentrl.model.planner import GIB, PlanError, StageHost, parameter_counts, plan_stages
from decentrl.model.run_stage import load_stage
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig

ROOMY = 64 * GIB


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> ModelSpec:
    return model_spec(tiny_model_dir)


def test_alike_peers_get_an_even_plan(spec: ModelSpec) -> None:
    choice = plan_stages(spec, [StageHost(ROOMY, 1.0)] * 2)
    assert choice.plan == StagePlan.even(spec.num_layers, 2)
    assert all("speed" in reason for reason in choice.reasons)


def test_a_faster_peer_gets_more_layers(spec: ModelSpec) -> None:
    choice = plan_stages(spec, [StageHost(ROOMY, 3.0), StageHost(ROOMY, 1.0)])
    assert choice.plan.stage_layers == (3, 1)


def test_memory_caps_a_stage_and_says_so(spec: ModelSpec) -> None:
    embed, head, layers = parameter_counts(spec)
    # Stage 1 (the head's) has room for its head and one layer in fp32-with-AdamW bytes.
    tight = StageHost(int(18 * (head + 1.5 * layers[0])), 10.0, reserve_bytes=0)
    choice = plan_stages(spec, [StageHost(ROOMY, 1.0), tight], "training")
    assert choice.plan.stage_layers == (3, 1)
    assert "capped by memory" in choice.reasons[1] and "speed" in choice.reasons[0]
    assert choice.stage_bytes[1] == 18 * (head + layers[3])


def test_a_model_that_fits_nowhere_names_what_is_missing(spec: ModelSpec) -> None:
    embed, head, layers = parameter_counts(spec)
    small = StageHost(int(2 * (max(embed, head) + layers[0]) * 1.2), 1.0, reserve_bytes=0)
    with pytest.raises(PlanError, match="holds 2 of the model's 4 layers"):
        plan_stages(spec, [small, small])
    with pytest.raises(PlanError, match="5 stages for a 4-layer model"):
        plan_stages(spec, [StageHost(ROOMY, 1.0)] * 5)


def test_stage_layers_must_name_every_stage(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="stage_layers"):
        parse_config({"model": str(tiny_model_dir), "num_stages": 2, "stage_layers": [4]})
    with pytest.raises(ValueError, match="stage_layers"):
        parse_config({"model": str(tiny_model_dir), "num_stages": 2, "stage_layers": [4, 0]})
    config = parse_config({"model": str(tiny_model_dir), "num_stages": 2, "stage_layers": [1, 2]})
    with pytest.raises(ValueError, match="add up to 3, not the model's 4"):
        load_stage(config, 0, torch.device("cpu"), torch.float32)


def test_an_uneven_plan_computes_what_the_whole_model_does(tiny_sharp_dir: Path) -> None:
    model = load_model(str(tiny_sharp_dir))
    config = parse_config({"model": str(tiny_sharp_dir), "num_stages": 2,
                           "stage_layers": [3, 1]})
    uneven = [load_stage(config, stage, torch.device("cpu"), torch.float32)
              for stage in range(2)]
    assert [len(stage.layers) for stage in uneven] == [3, 1]
    whole = build_stages(model.spec, StagePlan.even(model.spec.num_layers, 1), model.tensors,
                         torch.device("cpu"), torch.float32)
    greedy = SamplingConfig(temperature=0.0)
    prompts = [[1, 2, 3], [4, 5]]
    got = generate(LocalChain(uneven), prompts, 6, greedy, set(), 0, None)
    expected = generate(LocalChain(whole), prompts, 6, greedy, set(), 0, None)
    assert [g.tokens for g in got] == [g.tokens for g in expected]


def test_plan_command_prints_the_config_lines(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["plan", "--model", str(tiny_model_dir), "16:3", "16:1"])
    assert result.exit_code == 0, result.output
    assert "stage_layers = [3, 1]" in result.output and "stage 0: layers 0-2" in result.output
    refused = CliRunner().invoke(app, ["plan", "--model", str(tiny_model_dir), "16:x"])
    assert refused.exit_code != 0 and "MEMORY_GIB:SPEED" in refused.output
