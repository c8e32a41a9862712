"""Mixtral: Mistral's decoder (no biases; every layer attends through a sliding window of
`sliding_window` keys when the config sets one, none by default) with a sparse mixture-of-experts
MLP on every layer (model/moe.py: `num_local_experts` experts of `intermediate_size`, top
`num_experts_per_tok`, always renormalised). Its checkpoint names the MLP `block_sparse_moe`
(model/moe_checkpoint.py translates)."""

from __future__ import annotations

from decentrl.model.families.decoder import (
    Defaults,
    HFConfig,
    decoder_spec,
    layer_types,
    moe_fields,
)
from decentrl.model.spec import SLIDING_ATTENTION, ModelSpec, UnsupportedModel

MODEL_TYPE = "mixtral"
DEFAULTS = Defaults(num_key_value_heads=8, rms_norm_eps=1e-5,
                    max_position_embeddings=4096 * 32)
# MixtralConfig's defaults for the expert fields.
MOE_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2}


def read_spec(config: HFConfig) -> ModelSpec:
    if "layer_types" in config:
        raise UnsupportedModel("mixtral: layer_types is not a Mixtral field (transformers "
                               "ignores it); a Mixtral config slides every layer or none")
    num_layers = int(config["num_hidden_layers"])
    return decoder_spec(config, DEFAULTS,
                        **layer_types(config, config.get("sliding_window"),
                                      [SLIDING_ATTENTION] * num_layers),
                        **moe_fields(config, MOE_DEFAULTS))
