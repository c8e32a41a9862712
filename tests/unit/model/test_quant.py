"""Weight-only int8 for a LoRA run's frozen base (model/quant.py, `train.lora_base`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swarm_helpers import tiny_run_config

from decentrl.config import ConfigError
from decentrl.model.lora import LoRALinear, merge_lora
from decentrl.model.quant import dequantize_rows, quantize_rows
from decentrl.model.run_stage import load_stage

CPU = torch.device("cpu")


def test_rows_quantize_within_half_a_step_and_the_same_from_any_dtype() -> None:
    weight = torch.randn(64, 48)
    weight[3] = 0.0  # a zero row stays zero
    values, scale = quantize_rows(weight)
    assert values.dtype == torch.int8 and scale.dtype == torch.float32
    error = (dequantize_rows(values, scale, torch.float32) - weight.to(torch.bfloat16).float())
    assert bool((error.abs() <= scale[:, None] / 2 + 1e-7).all())
    assert bool((dequantize_rows(values, scale, torch.float32)[3] == 0).all())
    # Loaded in bf16 or in fp32, the base quantizes to the same values: every peer agrees.
    again = quantize_rows(weight.to(torch.bfloat16))
    assert torch.equal(again[0], values) and torch.equal(again[1], scale)


def int8_stage(model_dir: Path, frozen: torch.dtype | None) -> torch.nn.Module:
    config = tiny_run_config(model_dir, 2, train={"lora_rank": 4, "lora_base": "int8"})
    return load_stage(config, 0, CPU, torch.float32, frozen_dtype=frozen)


def test_replicas_and_the_trainer_hold_the_same_int8_base(tiny_model_dir: Path) -> None:
    learner = int8_stage(tiny_model_dir, torch.bfloat16)  # the trainer's: base bf16 first
    export_side = int8_stage(tiny_model_dir, None)  # an export's: base loaded in fp32
    served = int8_stage(tiny_model_dir, torch.bfloat16).to(CPU, torch.bfloat16)
    projections = [m for m in learner.modules() if isinstance(m, LoRALinear)]
    assert projections and all(m.weight.dtype == torch.int8 for m in projections)
    for one, other, third in zip(learner.state_dict().items(), export_side.state_dict().items(),
                                 served.state_dict().items(), strict=True):
        if one[0].endswith(("weight", "weight_scale")) and one[1].dtype in (torch.int8,
                                                                           torch.float32):
            assert torch.equal(one[1], other[1]), one[0]
        if one[1].dtype == torch.int8 or one[0].endswith("weight_scale"):
            # Cast to bf16 for serving, the int8 values and their fp32 scales stay as they are.
            assert third[1].dtype == one[1].dtype and torch.equal(third[1], one[1]), one[0]
    # An int8 projection takes about half a bf16 one's bytes.
    bf16 = sum(m.weight.numel() * 2 for m in projections)
    held = sum(m.weight.numel() + m.weight_scale.numel() * 4 for m in projections)
    assert held < 0.6 * bf16


def test_an_int8_stage_exports_its_dequantized_weights_merged(tiny_model_dir: Path) -> None:
    stage = int8_stage(tiny_model_dir, None)
    projection = next(m for m in stage.modules() if isinstance(m, LoRALinear))
    with torch.no_grad():
        projection.lora_b.fill_(0.01)
    expected = dequantize_rows(projection.weight, projection.weight_scale, torch.float32) + \
        (projection.lora_b @ projection.lora_a) * projection.scale
    tokens, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    valid = torch.ones(1, 3, dtype=torch.bool)
    before = stage(tokens, positions, valid)
    merge_lora(stage)
    merged = dict(stage.named_parameters())
    name = next(n for n, p in merged.items() if p.shape == expected.shape
                and torch.allclose(p, expected, atol=1e-6))
    assert merged[name].dtype == torch.float32
    torch.testing.assert_close(stage(tokens, positions, valid), before, atol=1e-5, rtol=0)


def test_an_int8_base_needs_lora(tiny_model_dir: Path) -> None:
    with pytest.raises((ConfigError, ValueError), match="lora_base"):
        tiny_run_config(tiny_model_dir, 2, train={"lora_base": "int8"})
