"""The family registry: every supported model_type reads into a ModelSpec; an unknown one is
refused naming the nearest supported family, a known-but-unported one naming itself, and a
feature a family does not implement is refused by name, never ignored."""

from __future__ import annotations

from typing import Any

import pytest

from decentrl.model.families import FAMILIES, spec_from_hf_config
from decentrl.model.rope import rope_specs
from decentrl.model.spec import UnsupportedModel

LLAMA: dict[str, Any] = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                         "intermediate_size": 64, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2,
                         "rms_norm_eps": 1e-5, "max_position_embeddings": 128}


def test_every_family_reads_a_minimal_config() -> None:
    assert set(FAMILIES) == {"llama", "qwen2", "mistral", "qwen3", "olmo2", "granite", "smollm3",
                             "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral"}
    for model_type in FAMILIES:
        spec = spec_from_hf_config({**LLAMA, "model_type": model_type, "head_dim": 8})
        assert (spec.model_type, spec.num_layers, spec.head_dim) == (model_type, 4, 8)


@pytest.mark.parametrize(("model_type", "message"), [
    ("lama", r"model_type 'lama' is not supported; the nearest supported family is 'llama'"),
    ("qwen4", r"'qwen4' is not supported; the nearest supported family is 'qwen"),
    (None, r"model_type None is not supported"),
    ("gemma3", r"model_type 'gemma3' is not supported yet: multimodal Gemma 3 .*gemma3_text"),
    ("qwen2_moe", r"'qwen2_moe' is not supported: shared experts .*; the nearest supported "
                  r"mixture-of-experts families are qwen3_moe, mixtral"),
])
def test_unsupported_families_are_named(model_type: str | None, message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf_config({**LLAMA, "model_type": model_type})


@pytest.mark.parametrize(("fields", "message"), [
    ({"hidden_act": "gelu"}, r"llama: hidden_act 'gelu' is not supported"),
    ({"num_local_experts": 8}, r"mixture-of-experts configs \(\['num_local_experts'\]\)"),
    ({"attention_dropout": 0.1}, r"attention_dropout 0.1 is not supported"),
    ({"model_type": "mistral", "layer_types": ["full_attention"] * 4},
     r"mistral: layer_types \(alternating attention"),
    ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, r"no_rope_layers has 2 entries for 4"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["full_attention", "chunked_attention"] * 2},
     r"layer types \['chunked_attention'\] are not supported"),
    ({"num_key_value_heads": 3}, r"4 attention heads do not share 3 key/value heads"),
    ({"hidden_size": None}, r"the llama config has no hidden_size"),
    ({"model_type": "qwen3_moe", "shared_expert_intermediate_size": 8},
     r"qwen3_moe: shared experts \(shared_expert_intermediate_size\) are not supported"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1},
     r"mixtral: router_jitter_noise=0.1 is not supported"),
    ({"model_type": "mixtral", "num_experts_per_tok": 9}, r"num_experts_per_tok 9 exceeds"),
    ({"model_type": "qwen3_moe", "layer_types": ["full_attention"] * 4},
     r"qwen3_moe: layer_types is not a Qwen3-MoE field"),
])
def test_unimplemented_features_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_hf_config({**LLAMA, **fields})


def test_family_defaults_fill_what_a_config_leaves_out() -> None:
    minimal = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 32}
    qwen3 = spec_from_hf_config({**minimal, "model_type": "qwen3"})
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.max_positions) == (128, 32, 32768)
    smollm3 = spec_from_hf_config({**minimal, "model_type": "smollm3"})
    assert smollm3.tie_word_embeddings and smollm3.no_rope_layers == {3}
    theta = {"max_position_embeddings": 32768, "rope_theta": 2e6}
    assert smollm3.rope == rope_specs(theta, smollm3.head_dim)
    assert smollm3.rope != rope_specs({**theta, "rope_theta": 1e4}, smollm3.head_dim)
    mistral = spec_from_hf_config({**minimal, "model_type": "mistral"})
    assert mistral.sliding_window == 4096 and mistral.num_kv_heads == 8
    assert spec_from_hf_config({**minimal, "model_type": "mistral", "sliding_window": None}
                               ).layer_types == ()
    olmo2 = spec_from_hf_config({**minimal, "model_type": "olmo2"})
    assert (olmo2.rms_norm_eps, olmo2.num_kv_heads, olmo2.head_dim) == (1e-5, 32, 2)
    gemma2 = spec_from_hf_config({**minimal, "model_type": "gemma2"})
    assert (gemma2.head_dim, gemma2.num_kv_heads, gemma2.attention_scale) == (256, 4, 1 / 16)
    assert (gemma2.attention_softcap, gemma2.final_logit_softcap, gemma2.sliding_window) == \
        (50.0, 30.0, 4096)
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    assert gemma2.tie_word_embeddings and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = spec_from_hf_config({**minimal, "model_type": "gemma3_text",
                                  "num_hidden_layers": 12})
    assert gemma3.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 2
    assert (gemma3.attention_softcap, gemma3.final_logit_softcap) == (None, None)
    assert (gemma3.rope_of(5).theta, gemma3.rope_of(0).theta) == (1e6, 1e4)
    phi3 = spec_from_hf_config({**minimal, "model_type": "phi3"})
    assert (phi3.num_kv_heads, phi3.rms_norm_eps, phi3.max_positions) == (32, 1e-5, 4096)
    assert phi3.fused_projections and phi3.layer_types == ()
    qwen3_moe = spec_from_hf_config({**minimal, "model_type": "qwen3_moe",
                                     "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert qwen3_moe.moe is not None and qwen3_moe.sparse_layers == {1}
    assert (qwen3_moe.moe.num_experts, qwen3_moe.moe.top_k,
            qwen3_moe.moe.expert_intermediate_size, qwen3_moe.num_kv_heads) == (128, 8, 768, 4)
    # save_pretrained writes the count under one name, the other null.
    saved = spec_from_hf_config({**minimal, "model_type": "qwen3_moe", "num_experts": None,
                                 "num_local_experts": 4, "num_experts_per_tok": 2})
    assert saved.moe is not None and saved.moe.num_experts == 4
    mixtral = spec_from_hf_config({**minimal, "model_type": "mixtral"})
    assert mixtral.moe is not None and mixtral.sparse_layers == {0, 1, 2, 3}
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.layer_types) == (8, 2, ())
    llama = spec_from_hf_config({**minimal, "model_type": "llama"})
    assert (llama.rms_norm_eps, llama.max_positions, llama.tie_word_embeddings) == \
        (1e-6, 2048, False)
