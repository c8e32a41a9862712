"""Llama 2 and 3.x (and SmolLM, SmolLM2, TinyLlama...): the shared decoder as it is, pre-norm,
SiLU MLP. Reads `attention_bias` (biases on q, k, v and o), `mlp_bias`, and the RoPE type and
scaling (model/rope.py: Llama 3.x's `llama3` among them). `pretraining_tp` only splits matmuls in
Meta's original code: the same math, so it needs nothing."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, attention_bias, decoder_spec
from decentrl.model.spec import ModelSpec

MODEL_TYPE = "llama"
DEFAULTS = Defaults(max_position_embeddings=2048)


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(config, DEFAULTS, **attention_bias(config),
                        mlp_bias=bool(config.get("mlp_bias", False)))
