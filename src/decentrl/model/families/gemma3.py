"""Gemma 3 (text): Gemma 2's decoder (model/families/gemma2.py) with an RMSNorm over head_dim on
every query and key head (`q_norm`, `k_norm`, scaling by 1 + weight) before RoPE, one full layer
in `sliding_window_pattern` (6) unless `layer_types` says otherwise, a RoPE per layer type (the
sliding layers' base 1e4, the full layers' 1e6 and their scaling; model/rope.py), no soft-capping
by default. transformers never applies `attn_logit_softcapping` to Gemma 3 (its attention ignores
it), so neither does decentrl. A multimodal `gemma3` config is read through its `text_config`."""

from __future__ import annotations

from decentrl.model.families.decoder import Defaults, HFConfig, decoder_spec
from decentrl.model.families.gemma2 import gemma_config, gemma_features, soft_cap
from decentrl.model.spec import ModelSpec

MODEL_TYPE = "gemma3_text"
DEFAULTS = Defaults(num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                    max_position_embeddings=131_072, tie_word_embeddings=True)
SLIDING_WINDOW_PATTERN = 6


def read_spec(config: HFConfig) -> ModelSpec:
    full_every = int(config.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
    return decoder_spec(gemma_config(config), DEFAULTS,
                        **gemma_features(config, full_every=full_every), qk_norm="head",
                        final_logit_softcap=soft_cap(config, "final_logit_softcapping", None))
