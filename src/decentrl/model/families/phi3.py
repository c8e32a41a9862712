"""Phi-3 and Phi-3.5 (and Phi-4-mini, which shares the model type): Llama with fused projections
(`self_attn.qkv_proj` holds q, k and v; `mlp.gate_up_proj` the gate and up halves), longrope RoPE
scaling (short factors within `original_max_position_embeddings`, long ones past it; model/rope.py),
a `partial_rotary_factor` (only the leading dims of each head rotate), and a sliding window on
every layer when `sliding_window` is set. No biases. Residual and embedding dropout must be off."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, decoder_spec, required
from decentrl.model.spec import SLIDING_ATTENTION, ModelSpec, UnsupportedModel

MODEL_TYPE = "phi3"
DEFAULTS = Defaults(rms_norm_eps=1e-5, max_position_embeddings=4096)
DROPOUTS = ("resid_pdrop", "embd_pdrop")


def read_spec(config: HFConfig) -> ModelSpec:
    for name in DROPOUTS:
        if config.get(name):
            raise UnsupportedModel(f"phi3: {name} {config[name]} is not supported (only 0)")
    window = config.get("sliding_window")
    sliding = {} if window is None else {
        "layer_types": (SLIDING_ATTENTION,) * int(required(config, "num_hidden_layers")),
        "sliding_window": int(window)}
    return decoder_spec(config, DEFAULTS, fused_projections=True, **sliding)
