"""Qwen2 and Qwen2.5: biases on q, k and v (always, and none on o), and an optional sliding window
(`use_sliding_window`, `sliding_window`) on the layers from `max_window_layers` on, or on those
`layer_types` names."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, decoder_spec, layer_types
from decentrl.model.spec import FULL_ATTENTION, SLIDING_ATTENTION, LayerType, ModelSpec

MODEL_TYPE = "qwen2"
DEFAULTS = Defaults(num_key_value_heads=32, max_position_embeddings=32768)


def sliding_layers(config: HFConfig) -> dict[str, object]:
    """Qwen2's (and Qwen3's) sliding-window fields: the window when `use_sliding_window`, on
    layer `max_window_layers` and after unless `layer_types` says otherwise."""
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    first = int(config.get("max_window_layers", 28))
    derived: list[LayerType] = [SLIDING_ATTENTION if layer >= first else FULL_ATTENTION
                                for layer in range(int(config["num_hidden_layers"]))]
    return layer_types(config, window, derived)


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(config, DEFAULTS, qkv_bias=True, **sliding_layers(config))
