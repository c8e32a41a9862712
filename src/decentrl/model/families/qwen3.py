"""Qwen3 (dense): Qwen2's sliding-window fields, plus an RMSNorm over head_dim on every query and
key head (`q_norm`, `k_norm`) before RoPE; `attention_bias` puts biases on q, k, v and o (none by
default); head_dim defaults to 128, not hidden_size / heads."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, attention_bias, decoder_spec
from decentrl.model.families.qwen2 import sliding_layers
from decentrl.model.spec import ModelSpec

MODEL_TYPE = "qwen3"
DEFAULTS = Defaults(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768)


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(config, DEFAULTS, **attention_bias(config), qk_norm="head",
                        **sliding_layers(config))
