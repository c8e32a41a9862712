"""Qwen3-MoE: Qwen3's attention (an RMSNorm over head_dim on every query and key head,
`attention_bias` on q, k, v and o) with a sparse mixture-of-experts MLP (model/moe.py: `num_experts`
experts of `moe_intermediate_size`, top `num_experts_per_tok`, renormalised when `norm_topk_prob`)
on the layers `decoder_sparse_step` and `mlp_only_layers` leave sparse; the others keep a dense
SiLU MLP of `intermediate_size`, without biases. `use_sliding_window` slides every layer through
`sliding_window` keys (Qwen3-MoE has no `max_window_layers`). head_dim defaults to
hidden_size / heads."""

from __future__ import annotations

from decentrl.model.families.decoder import (
    Defaults,
    HFConfig,
    attention_bias,
    decoder_spec,
    layer_types,
    moe_fields,
)
from decentrl.model.spec import SLIDING_ATTENTION, ModelSpec, UnsupportedModel

MODEL_TYPE = "qwen3_moe"
DEFAULTS = Defaults(num_key_value_heads=4, max_position_embeddings=32768)
# Qwen3MoeConfig's defaults for the expert fields.
MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": False, "decoder_sparse_step": 1}


def read_spec(config: HFConfig) -> ModelSpec:
    if "layer_types" in config:
        raise UnsupportedModel("qwen3_moe: layer_types is not a Qwen3-MoE field (transformers "
                               "ignores it); a Qwen3-MoE config slides every layer or none")
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    num_layers = int(config["num_hidden_layers"])
    return decoder_spec(config, DEFAULTS, **attention_bias(config), qk_norm="head",
                        **layer_types(config, window, [SLIDING_ATTENTION] * num_layers),
                        **moe_fields(config, MOE_DEFAULTS))
