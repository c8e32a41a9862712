"""OLMo 2: norms after each sublayer instead of before (`post_attention_layernorm` on attention's
output and `post_feedforward_layernorm` on the MLP's, each before the residual add; no input
norm), RMSNorm over the whole q and k projections (`q_norm`, `k_norm`) before RoPE, and norms
that scale by their weight in fp32 before casting back. `attention_bias`: biases on q, k, v and
o."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, attention_bias, decoder_spec
from decentrl.model.spec import ModelSpec

MODEL_TYPE = "olmo2"
DEFAULTS = Defaults(rms_norm_eps=1e-5, max_position_embeddings=2048)


def read_spec(config: HFConfig) -> ModelSpec:
    return decoder_spec(config, DEFAULTS, **attention_bias(config), norm_placement="post",
                        norm_kind="rms_fp32", qk_norm="full")
