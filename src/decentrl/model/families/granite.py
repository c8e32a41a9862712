"""Granite (3.x dense): Llama with four multipliers. `embedding_multiplier` scales the embeddings,
`attention_multiplier` is the attention scale (instead of 1 / sqrt(head_dim)),
`residual_multiplier` scales each sublayer's output before the residual add, and the logits are
divided by `logits_scaling`. `attention_bias` (q, k, v and o) and `mlp_bias` as Llama's."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, attention_bias, decoder_spec
from decentrl.model.spec import ModelSpec

MODEL_TYPE = "granite"
DEFAULTS = Defaults(max_position_embeddings=2048)


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(
        config, DEFAULTS, **attention_bias(config), mlp_bias=bool(config.get("mlp_bias", False)),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logits_divisor=float(config.get("logits_scaling", 1.0)))
