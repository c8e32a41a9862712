"""The family registry: a Hugging Face config's `model_type` -> the family module that reads it
into a ModelSpec (model/spec.py), which the shared decoder (model/blocks.py, model/stages.py)
builds itself from.

A family module says in its docstring what it changes relative to the shared decoder, reads only
its own config fields, refuses what it does not implement, and defines:
    MODEL_TYPE: str                                  the config's `model_type`
    DEFAULTS: decoder.Defaults                       its config class's defaults
    def read_spec(config: HFConfig) -> ModelSpec     (most call decoder.decoder_spec)
Adding a family is such a module, listed in FAMILY_MODULES, and its conformance test
(tests/unit/model/families/)."""

from __future__ import annotations

import difflib

from decentrl.model.families import (
    gemma2,
    gemma3,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from decentrl.model.families.decoder import HFConfig
from decentrl.model.moe import MOE_FAMILIES, REFUSED_MOE_FAMILIES
from decentrl.model.spec import ModelSpec, UnsupportedModel

FAMILY_MODULES = (llama, qwen2, mistral, qwen3, olmo2, granite, smollm3, gemma2, gemma3, phi3,
                  qwen3_moe, mixtral)
FAMILIES = {module.MODEL_TYPE: module.read_spec for module in FAMILY_MODULES}
# Families transformers has that this registry does not read yet, and why.
NOT_YET_SUPPORTED = {
    "gemma3": "multimodal Gemma 3 (its decoder's weights sit under language_model.; a text-only "
              "gemma3_text checkpoint runs)",
}


def spec_from_hf_config(config: HFConfig) -> ModelSpec:
    """The ModelSpec of a Hugging Face config (a config.json's contents)."""
    model_type = config.get("model_type")
    read_spec = FAMILIES.get(str(model_type))
    if read_spec is not None:
        return read_spec(config)
    supported = ", ".join(sorted(FAMILIES))
    if model_type in REFUSED_MOE_FAMILIES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported: "
                               f"{REFUSED_MOE_FAMILIES[model_type]}; the nearest supported "
                               f"mixture-of-experts families are {', '.join(MOE_FAMILIES)}")
    if model_type in NOT_YET_SUPPORTED:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported yet: "
                               f"{NOT_YET_SUPPORTED[model_type]}; supported: {supported}")
    nearest = difflib.get_close_matches(str(model_type), FAMILIES, n=1, cutoff=0.0)
    raise UnsupportedModel(f"model_type {model_type!r} is not supported; the nearest supported "
                           f"family is {nearest[0]!r} (supported: {supported})")
