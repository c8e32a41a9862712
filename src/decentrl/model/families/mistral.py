"""Mistral: every layer attends through a sliding window of `sliding_window` keys (4096 when the
config leaves it out; null turns it off). No biases. Alternating `layer_types` are Ministral's,
which transformers' Mistral ignores, so they are refused rather than run one way or the other."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, decoder_spec, layer_types
from decentrl.model.spec import SLIDING_ATTENTION, ModelSpec, UnsupportedModel

MODEL_TYPE = "mistral"
DEFAULTS = Defaults(num_key_value_heads=8, max_position_embeddings=4096 * 32)


def read_spec(config: HFConfig) -> ModelSpec:
    if "layer_types" in config:
        raise UnsupportedModel("mistral: layer_types (alternating attention, Ministral's) is not "
                               "supported; a Mistral config slides every layer or none")
    window = config.get("sliding_window", 4096)
    num_layers = int(config["num_hidden_layers"])
    return decoder_spec(config, DEFAULTS,
                        **layer_types(config, window, [SLIDING_ATTENTION] * num_layers))
