"""The config fields every family reads the same way (sizes, norm epsilon, activation, RoPE, tied
head), with each family's own defaults for the ones a config.json may leave out, the
mixture-of-experts fields of the families that have experts (`moe_fields`), and the refusal of
what no family here implements (experts in a dense family, attention dropout)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from decentrl.model.moe import UnsupportedMoEConfig, moe_spec_from_hf_config, sparse_layer_ids
from decentrl.model.rope import rope_specs
from decentrl.model.spec import (
    FULL_ATTENTION,
    Activation,
    LayerType,
    ModelSpec,
    UnsupportedModel,
)

HFConfig = Mapping[str, Any]
# Fields that make a config a mixture of experts (Mixtral's, Qwen-MoE's, and others').
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
# The two names a config.json may give the expert count under.
EXPERT_COUNT = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class Defaults:
    """A family's config-class defaults for the fields a config.json may leave out."""

    num_key_value_heads: int | None = None  # None: one per attention head
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False


def required(config: HFConfig, name: str) -> Any:
    if config.get(name) is None:
        raise UnsupportedModel(f"the {config.get('model_type')} config has no {name}")
    return config[name]


def decoder_spec(config: HFConfig, defaults: Defaults, **features: Any) -> ModelSpec:
    """The ModelSpec of `config`: the shared fields read here, the family's `features` (ModelSpec
    fields) as the family module read them."""
    model_type = str(config.get("model_type"))
    moe = [name for name in MOE_FIELDS if config.get(name)]
    if moe and "moe" not in features:
        raise UnsupportedModel(f"{model_type}: mixture-of-experts configs ({moe}) are not "
                               "supported by this family")
    if config.get("attention_dropout"):
        raise UnsupportedModel(f"{model_type}: attention_dropout {config['attention_dropout']} "
                               "is not supported (only 0)")
    activation = config.get("hidden_act", "silu")
    if activation not in get_args(Activation):
        raise UnsupportedModel(f"{model_type}: hidden_act {activation!r} is not supported "
                               f"(supported: {get_args(Activation)})")
    hidden = int(required(config, "hidden_size"))
    heads = int(required(config, "num_attention_heads"))
    head_dim = config.get("head_dim", defaults.head_dim) or hidden // heads
    max_positions = int(config.get("max_position_embeddings", defaults.max_position_embeddings))
    return ModelSpec(
        model_type=model_type,
        vocab_size=int(required(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required(config, "intermediate_size")),
        num_layers=int(required(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", defaults.num_key_value_heads)
                         or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", defaults.rms_norm_eps)),
        max_positions=max_positions,
        rope=rope_specs({"max_position_embeddings": max_positions, **config}, int(head_dim)),
        hidden_act=activation,
        tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                            defaults.tie_word_embeddings)),
        **features,
    )


def moe_fields(config: HFConfig, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The `moe` and `sparse_layers` ModelSpec fields of a mixture-of-experts family's config,
    `defaults` (its config class's) filling the expert fields it leaves out. model/moe.py reads
    them and refuses what SparseMoE cannot reproduce."""
    given = {name: value for name, value in config.items() if value is not None}
    if any(name in given for name in EXPERT_COUNT):
        # transformers saves the expert count under either name (the other null): one given,
        # the family's default for the other must not stand in for it.
        defaults = {name: value for name, value in defaults.items() if name not in EXPERT_COUNT}
    config = {**defaults, **given}
    try:
        return {"moe": moe_spec_from_hf_config(config), "sparse_layers": sparse_layer_ids(config)}
    except UnsupportedMoEConfig as error:
        raise UnsupportedModel(f"{config.get('model_type')}: {error}") from error


def attention_bias(config: HFConfig) -> dict[str, bool]:
    """HF Llama's `attention_bias` (and its followers'): biases on q, k, v and o alike."""
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def layer_types(config: HFConfig, window: int | None,
                derived: list[LayerType]) -> dict[str, Any]:
    """The `layer_types` and `sliding_window` ModelSpec fields of a family whose config may turn
    on a sliding window (`window`, None when off) for some layers: the config's own
    `layer_types`, else `derived` (what the family's config class derives). With the window off,
    no layer slides, whatever `layer_types` says (as transformers runs it)."""
    if window is None:
        return {}
    types = tuple(config.get("layer_types") or derived)
    if set(types) == {FULL_ATTENTION}:
        return {}
    return {"layer_types": types, "sliding_window": int(window)}
