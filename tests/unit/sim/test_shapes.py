"""The simulator's model shapes (sim/shapes.py): parameter counts against published totals and
against real stages of every family's tiny model, and the FLOPs and bytes they derive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.model.families import spec_from_hf_config
from decentrl.model.loading import LoadedModel, gguf_path, load_model
from decentrl.model.stages import StagePlan, build_stages
from decentrl.model.tiny import make_tiny_model
from decentrl.sim.shapes import LLAMA_8B, SMOLLM2_135M, ModelShape
from tests.unit.model.families.cases import family_cases
from tests.unit.model.families.conformance import FamilyCase


def stage_sizes(model: LoadedModel, num_stages: int) -> list[int]:
    """The parameters of each stage decentrl builds of `model`."""
    plan = StagePlan.even(model.spec.num_layers, num_stages)
    stages = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)
    return [sum(p.numel() for p in stage.parameters()) for stage in stages]


def test_published_totals() -> None:
    # SmolLM2-135M: 134,515,008 parameters, "135M"; Llama-3.1-8B: 8,030,261,248, "8.03B".
    assert SMOLLM2_135M.checkpoint_parameters() == pytest.approx(135e6, rel=0.01)
    assert LLAMA_8B.checkpoint_parameters() == pytest.approx(8.03e9, rel=0.01)
    assert LLAMA_8B.checkpoint_parameters() == 8_030_261_248


@pytest.mark.slow  # reads the real model's GGUF metadata: about 5 s
def test_smollm2_matches_the_bundled_model() -> None:
    from decentrl.model.gguf import gguf_config

    spec = spec_from_hf_config(gguf_config(gguf_path()))
    assert ModelShape.from_spec(spec, name=SMOLLM2_135M.name) == SMOLLM2_135M


def test_tied_head_is_a_copy_on_the_last_stage() -> None:
    whole = SMOLLM2_135M.stage_parameters(30, first=True, last=True)
    assert whole == SMOLLM2_135M.checkpoint_parameters() + 49152 * 576
    untied_whole = LLAMA_8B.stage_parameters(32, first=True, last=True)
    assert untied_whole == LLAMA_8B.checkpoint_parameters()


def test_stages_add_up_to_the_whole() -> None:
    first = LLAMA_8B.stage_parameters(10, first=True, last=False)
    middle = LLAMA_8B.stage_parameters(11, first=False, last=False)
    last = LLAMA_8B.stage_parameters(11, first=False, last=True)
    assert first + middle + last == LLAMA_8B.checkpoint_parameters()


def test_from_spec_counts_the_tiny_model_exactly(tiny_model: LoadedModel) -> None:
    shape = ModelShape.from_spec(tiny_model.spec)
    sizes = stage_sizes(tiny_model, 2)
    layers = StagePlan.even(shape.layers, 2)
    assert sizes == [shape.stage_parameters(len(layers.layers(0)), first=True, last=False),
                     shape.stage_parameters(len(layers.layers(1)), first=False, last=True)]
    stored = sum(tensor.numel() for tensor in tiny_model.tensors.values())
    assert shape.checkpoint_parameters() == stored


@pytest.mark.parametrize("case", family_cases(), ids=str)
def test_from_spec_counts_every_family(case: FamilyCase, tmp_path: Path) -> None:
    make_tiny_model(tmp_path, seed=3, num_layers=4, model_type=case.model_type, **case.config)
    model = load_model(str(tmp_path))
    if model.spec.moe is not None:
        with pytest.raises(ValueError, match="mixture-of-experts"):
            ModelShape.from_spec(model.spec)
        return
    shape = ModelShape.from_spec(model.spec)
    assert stage_sizes(model, 1) == [shape.stage_parameters(4, first=True, last=True)]
    assert stage_sizes(model, 4)[1] == shape.stage_parameters(1, first=False, last=False)


def test_kv_and_wire_bytes() -> None:
    # Llama-3.1-8B: 8 kv heads x 128 x (key + value) x 2 bytes = 4 KiB a position a layer.
    assert LLAMA_8B.kv_bytes_per_token_per_layer(2) == 4096
    assert LLAMA_8B.kv_bytes(32, 1000) == 32 * 1000 * 4096
    assert SMOLLM2_135M.hidden_state_bytes("fp32") == 4 * 576
    assert SMOLLM2_135M.hidden_state_bytes("bf16") == 2 * 576
    assert SMOLLM2_135M.hidden_state_bytes("int8") == 576 + 4
    with pytest.raises(ValueError, match="codec"):
        SMOLLM2_135M.hidden_state_bytes("fp16")  # type: ignore[arg-type]


def test_forward_flops() -> None:
    shape = LLAMA_8B
    per_layer = 2 * shape.layer_matmul_parameters + 4 * 100 * shape.q_width
    assert shape.forward_flops_per_token(2, 100, last=False) == 2 * per_layer
    head = 2 * shape.vocab * shape.hidden
    assert shape.forward_flops_per_token(2, 100, last=True) == 2 * per_layer + head
    # A prefill of 3 positions after 5 costs what its 3 positions cost one by one.
    one_by_one = sum(shape.forward_flops_per_token(4, context, last=True)
                     for context in (6, 7, 8))
    assert shape.forward_flops(4, 3, last=True, past=5) == one_by_one
    # About 2 FLOPs a parameter a position at short context.
    assert shape.forward_flops_per_token(32, 1, last=True) == pytest.approx(
        2 * (shape.checkpoint_parameters() - shape.vocab * shape.hidden), rel=0.01)


def test_stage_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="1 to 30 layers"):
        SMOLLM2_135M.stage_parameters(31, first=True, last=True)
    with pytest.raises(ValueError, match="1 to 30 layers"):
        SMOLLM2_135M.forward_flops_per_token(0, 10, last=False)
    with pytest.raises(ValueError, match="evenly"):
        ModelShape("odd", 2, 64, 128, heads=4, kv_heads=3, head_dim=16, vocab=100,
                   tied_embeddings=False)
