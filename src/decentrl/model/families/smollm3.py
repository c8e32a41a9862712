"""SmolLM3: Llama without RoPE in some layers (`no_rope_layers[i]` is 0 there; by default every
`no_rope_layer_interval`-th layer), an optional sliding window (`use_sliding_window`,
`sliding_window`) on the layers `layer_types` names (by default those without RoPE), a tied head
and a RoPE theta of 2e6 unless the config says otherwise. `attention_bias` (q, k, v and o) and
`mlp_bias` as Llama's."""

from __future__ import annotations

from decentrl.model.families.decoder import (
    Defaults,
    HFConfig,
    attention_bias,
    decoder_spec,
    layer_types,
)
from decentrl.model.spec import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    LayerType,
    ModelSpec,
    UnsupportedModel,
)

MODEL_TYPE = "smollm3"
DEFAULTS = Defaults(num_key_value_heads=4, max_position_embeddings=32768,
                    tie_word_embeddings=True)
DEFAULT_THETA = 2_000_000.0


def read_spec(config: HFConfig) -> ModelSpec:
    num_layers = int(config["num_hidden_layers"])
    interval = int(config.get("no_rope_layer_interval", 4))
    uses_rope = config.get("no_rope_layers") or [
        int((layer + 1) % interval != 0) for layer in range(num_layers)]
    if len(uses_rope) != num_layers:
        raise UnsupportedModel(f"smollm3: no_rope_layers has {len(uses_rope)} entries for "
                               f"{num_layers} layers")
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    derived: list[LayerType] = [FULL_ATTENTION if rope else SLIDING_ATTENTION
                                for rope in uses_rope]
    rope_params = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" not in rope_params:
        config = {**config, "rope_theta": DEFAULT_THETA}
    return decoder_spec(
        config, DEFAULTS, **attention_bias(config), mlp_bias=bool(config.get("mlp_bias", False)),
        no_rope_layers=frozenset(layer for layer, rope in enumerate(uses_rope) if not rope),
        **layer_types(config, window, derived))
