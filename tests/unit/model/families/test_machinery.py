"""Gemma's decoder features in isolation (test_gemma2.py and test_gemma3.py check them against
transformers), on a tiny Llama spec: soft-capped attention is SDPA's attention when the cap is far
above the scores, and caps them when it is not; the final soft-cap bounds the logits; sandwich
norms with Gemma's (1 + weight) scaling and a tanh-GELU MLP build and run under Hugging Face
names."""

from __future__ import annotations

from dataclasses import replace

import torch

from decentrl.model.families import spec_from_hf_config
from decentrl.model.spec import ModelSpec
from decentrl.model.stages import StageModule, StagePlan
from tests.unit.model.families.conformance import padded_batch, relative_difference

SPEC = spec_from_hf_config({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                            "intermediate_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2,
                            "rms_norm_eps": 1e-5, "max_position_embeddings": 128})


def logits(spec: ModelSpec, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    torch.manual_seed(0)
    stage = StageModule(spec, StagePlan.even(spec.num_layers, 1), 0)
    if state is not None:
        stage.load_state_dict(state)
    ids, valid = padded_batch((9, 4), spec.vocab_size, seed=0)
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return stage(ids, positions, valid)[valid]


def test_soft_caps() -> None:
    plain = logits(SPEC)
    assert relative_difference(logits(replace(SPEC, attention_softcap=1e6)), plain) <= 1e-5
    assert relative_difference(logits(replace(SPEC, attention_softcap=1e-3)), plain) > 1e-3
    cap = float(plain.abs().max()) / 4
    capped = logits(replace(SPEC, final_logit_softcap=cap))
    assert float(capped.abs().max()) <= cap
    assert torch.allclose(capped, cap * torch.tanh(plain / cap), atol=1e-6, rtol=0)


def test_sandwich_norms_with_gemma_scaling_and_tanh_gelu() -> None:
    gemma_like = replace(SPEC, norm_placement="sandwich", norm_kind="rms_offset",
                         hidden_act="gelu_pytorch_tanh", attention_scale=0.1,
                         embedding_multiplier=32 ** 0.5)
    stage = StageModule(gemma_like, StagePlan.even(2, 1), 0)
    assert {"model.layers.0.pre_feedforward_layernorm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.input_layernorm.weight"} <= set(stage.hf_names().values())
    # Gemma's norm weights are offsets from 1: zeros are the identity scaling.
    assert all(not norm.weight.any() for name, norm in stage.named_modules()
               if name.endswith("layernorm"))
    assert torch.isfinite(logits(gemma_like)).all()
