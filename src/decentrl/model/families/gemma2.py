"""Gemma 2: sandwich norms (`input_layernorm` and `post_attention_layernorm` around attention,
`pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP), each scaling by
(1 + weight) in fp32; embeddings times sqrt(hidden_size), that factor rounded to the compute dtype;
attention scaled by `query_pre_attn_scalar` ** -0.5 and its scores soft-capped
(`attn_logit_softcapping`), the final logits too (`final_logit_softcapping`); sliding-window and
full layers alternating (`layer_types`, by default every odd layer full); a tanh-GELU MLP
(`hidden_activation`); a tied head. `attention_bias` puts biases on q, k, v and o."""

from __future__ import annotations

from typing import Any

from decentrl.model.families.decoder import (
    Defaults,
    HFConfig,
    attention_bias,
    decoder_spec,
    required,
)
from decentrl.model.spec import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LayerType,
    ModelSpec,
    UnsupportedModel,
)

MODEL_TYPE = "gemma2"
DEFAULTS = Defaults(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                    max_position_embeddings=8192, tie_word_embeddings=True)
QUERY_PRE_ATTN_SCALAR = 256
SLIDING_WINDOW = 4096


def gemma_features(config: HFConfig, full_every: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share, as ModelSpec fields; their sliding and full layers alternate,
    every `full_every`-th layer full unless `layer_types` says otherwise."""
    model_type = config.get("model_type")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel(f"{model_type}: use_bidirectional_attention (an encoder's "
                               "attention) is not supported; decentrl runs causal decoders")
    hidden = int(required(config, "hidden_size"))
    num_layers = int(required(config, "num_hidden_layers"))
    derived: list[LayerType] = [FULL_ATTENTION if (layer + 1) % full_every == 0
                                else SLIDING_ATTENTION for layer in range(num_layers)]
    window = config.get("sliding_window", SLIDING_WINDOW)
    return {
        **attention_bias(config),
        "norm_placement": "sandwich",
        "norm_kind": "rms_offset",
        "embedding_multiplier": hidden ** 0.5,
        "embedding_multiplier_rounded": True,
        "attention_scale": float(config.get("query_pre_attn_scalar", QUERY_PRE_ATTN_SCALAR))
        ** -0.5,
        "layer_types": tuple(config.get("layer_types") or derived),
        "sliding_window": None if window is None else int(window),
    }


def soft_cap(config: HFConfig, name: str, default: float | None) -> float | None:
    """The soft-cap `config[name]` (`default` when absent; null: none)."""
    value = config.get(name, default)
    return None if value is None else float(value)


def gemma_config(config: HFConfig) -> HFConfig:
    """`config` with Gemma's activation field (`hidden_activation`) where decoder_spec reads
    one: transformers' Gemma ignores `hidden_act`."""
    return {**config, "hidden_act": config.get("hidden_activation", "gelu_pytorch_tanh")}


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(gemma_config(config), DEFAULTS, **gemma_features(config, full_every=2),
                        attention_softcap=soft_cap(config, "attn_logit_softcapping", 50.0),
                        final_logit_softcap=soft_cap(config, "final_logit_softcapping", 30.0))
