"""Every RoPE type gives transformers' own cos/sin tables (its rotary embedding classes, fed the
same config) and rotation; the older config.json forms read as the transformers-5 form; a
malformed or unknown RoPE is refused with a message naming the problem."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import AutoConfig, Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb as olmo2_apply
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

from decentrl.model.rope import (
    RopeConfigError,
    RopeSpec,
    apply_rotary,
    rope_specs,
    rotary_tables,
)

HEAD_DIM = 64
MAX_POSITIONS = 256
# The pretrained context of the scaled types: small, so positions past it stay cheap.
ORIGINAL = 64
# Longest positions of the forwards compared: within the original context, at both sides of
# longrope's switch (max + 1 = 64 keeps the short factors, 65 takes the long ones), at both
# sides of dynamic NTK's max_position_embeddings, and well past both.
LAST_POSITIONS = [10, ORIGINAL - 1, ORIGINAL, MAX_POSITIONS - 1, MAX_POSITIONS, 700]
# Relative to the tables' largest entry (cos/sin near 0 have no meaningful relative error).
RELATIVE = 1e-6

LLAMA_ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10_000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
             "rope_theta": 10_000.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0,
                    "original_max_position_embeddings": ORIGINAL, "rope_theta": 50_000.0,
                    "mscale": 1.0, "mscale_all_dim": 0.707,
                    "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": ORIGINAL,
                              "rope_theta": 10_000.0},
    # theta 5e5 over a 64-position context: low, medium and high frequency bands all occur.
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
               "rope_theta": 500_000.0},
}


def batch_positions(last: int, length: int = 24) -> torch.Tensor:
    """Two rows of `length` positions: one ending at `last`, one left-padded (its padding at
    position 0) ending near last / 2, as a left-padded batch numbers them."""
    first = torch.clamp(torch.arange(last - length + 1, last + 1), min=0)
    second = torch.clamp(torch.arange(length) + last // 2 - length + 1, min=0)
    return torch.stack([first, second])


def assert_tables_equal(name: str, ours: tuple[torch.Tensor, torch.Tensor],
                        theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.shape[1] == 1 and mine[:, 0].shape == reference.shape
        assert mine.dtype == reference.dtype == torch.float32
        difference = (mine[:, 0] - reference).abs().max().item()
        assert difference <= RELATIVE * reference.abs().max().item(), (name, difference)


def llama_config(rope_parameters: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                       num_hidden_layers=1, intermediate_size=32, vocab_size=32,
                       max_position_embeddings=MAX_POSITIONS,
                       rope_parameters=dict(rope_parameters))


def phi3_config(kind: str, partial: float) -> Phi3Config:
    rotary_dim = int(HEAD_DIM * partial)
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": 10_000.0}
    if kind == "longrope":
        rope["short_factor"] = [1.0 + 0.05 * i for i in range(rotary_dim // 2)]
        rope["long_factor"] = [1.0 + 0.7 * i for i in range(rotary_dim // 2)]
    return Phi3Config(hidden_size=2 * HEAD_DIM, num_attention_heads=2, num_hidden_layers=1,
                      intermediate_size=32, vocab_size=32, max_position_embeddings=MAX_POSITIONS,
                      original_max_position_embeddings=ORIGINAL, rope_parameters=rope,
                      partial_rotary_factor=partial)


@pytest.mark.parametrize("last", LAST_POSITIONS)
@pytest.mark.parametrize("name", list(LLAMA_ROPES))
def test_llama_rope_types_match_transformers(name: str, last: int) -> None:
    config = llama_config(LLAMA_ROPES[name])
    spec = rope_specs(config.to_dict(), HEAD_DIM)["full_attention"]
    assert spec.kind == LLAMA_ROPES[name]["rope_type"]
    positions = batch_positions(last)
    # A fresh module each time: transformers' dynamic RoPE remembers the longest length seen.
    theirs = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    assert_tables_equal(name, rotary_tables(positions, spec, torch.float32), theirs)


@pytest.mark.parametrize("last", LAST_POSITIONS)
@pytest.mark.parametrize(("kind", "partial"),
                         [("longrope", 1.0), ("longrope", 0.5), ("default", 0.5)])
def test_phi3_ropes_match_transformers(kind: str, partial: float, last: int) -> None:
    config = phi3_config(kind, partial)
    spec = rope_specs(config.to_dict(), HEAD_DIM)["full_attention"]
    assert (spec.kind, spec.rotary_dim) == (kind, int(HEAD_DIM * partial))
    positions = batch_positions(last)
    theirs = Phi3RotaryEmbedding(config)(torch.zeros(1), positions)
    assert_tables_equal(f"phi3 {kind} x{partial}", rotary_tables(positions, spec, torch.float32),
                        theirs)


def test_longrope_switches_to_its_long_factors_past_the_original_context() -> None:
    spec = rope_specs(phi3_config("longrope", 1.0).to_dict(), HEAD_DIM)["full_attention"]
    assert spec.depends_on_length and spec.original_max_positions == ORIGINAL
    # Phi-3 gives no factor: max / original stands for it in the attention scaling.
    assert spec.factor == MAX_POSITIONS / ORIGINAL and spec.attention_factor > 1
    # Position 10's cos in a forward whose longest position is 63 (short), then 64 (long).
    at_position_10 = [rotary_tables(torch.arange(last + 1)[None], spec, torch.float32)[0][0, 0, 10]
                      for last in (ORIGINAL - 1, ORIGINAL)]
    assert torch.equal(rotary_tables(torch.tensor([[10]]), spec, torch.float32)[0][0, 0, 0],
                       at_position_10[0])  # a short forward uses the short factors
    assert not torch.allclose(at_position_10[0], at_position_10[1])


@pytest.mark.parametrize("full_rope", [
    {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
     "rope_theta": 1_000_000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1_000_000.0},
])
def test_gemma3_ropes_per_layer_type_match_transformers(full_rope: dict[str, Any]) -> None:
    config = Gemma3TextConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, head_dim=HEAD_DIM,
                              num_hidden_layers=2, intermediate_size=32, vocab_size=32,
                              layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=MAX_POSITIONS,
                              rope_parameters={"full_attention": dict(full_rope),
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 10_000.0}})
    specs = rope_specs(config.to_dict(), HEAD_DIM)
    assert specs["full_attention"].kind == full_rope["rope_type"]
    assert (specs["sliding_attention"].kind, specs["sliding_attention"].theta) == ("default", 1e4)
    for last in LAST_POSITIONS:
        positions = batch_positions(last)
        embedding = Gemma3RotaryEmbedding(config)
        for layer_type, spec in specs.items():
            theirs = embedding(torch.zeros(1), positions, layer_type)
            assert_tables_equal(f"gemma3 {layer_type} {spec.kind}",
                                rotary_tables(positions, spec, torch.float32), theirs)


def test_dynamic_equals_transformers_while_positions_grow_and_is_stateless() -> None:
    """Decoding past max_position_embeddings one token at a time: each step's tables equal
    transformers' (which remembers the longest length); a later shorter forward differs, since
    ours follows the length of each call alone."""
    config = llama_config(LLAMA_ROPES["dynamic"])
    spec = rope_specs(config.to_dict(), HEAD_DIM)["full_attention"]
    embedding = LlamaRotaryEmbedding(config)
    steps = [batch_positions(MAX_POSITIONS - 6)] + [
        torch.tensor([[last], [last // 2]])
        for last in range(MAX_POSITIONS - 5, MAX_POSITIONS + 40)]
    for positions in steps:
        assert_tables_equal("dynamic decoding", rotary_tables(positions, spec, torch.float32),
                            embedding(torch.zeros(1), positions))
    shorter = torch.tensor([[MAX_POSITIONS + 10]])
    assert not torch.allclose(rotary_tables(shorter, spec, torch.float32)[0][:, 0],
                              embedding(torch.zeros(1), shorter)[0])


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
def test_apply_rotary_matches_transformers(rotary_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(2, 3, 24, HEAD_DIM, generator=generator)
    keys = torch.randn(2, 1, 24, HEAD_DIM, generator=generator)
    spec = RopeSpec.from_hf(
        {"rope_type": "default", "partial_rotary_factor": rotary_dim / HEAD_DIM},
        HEAD_DIM, MAX_POSITIONS)
    cos, sin = rotary_tables(batch_positions(300), spec, torch.float32)
    reference = llama_apply if rotary_dim == HEAD_DIM else phi3_apply
    expected_queries, expected_keys = reference(queries, keys, cos[:, 0], sin[:, 0])
    for ours, expected, original in [(apply_rotary(queries, cos, sin), expected_queries, queries),
                                     (apply_rotary(keys, cos, sin), expected_keys, keys)]:
        assert torch.allclose(ours, expected, rtol=RELATIVE, atol=RELATIVE)
        assert torch.equal(ours[..., rotary_dim:], original[..., rotary_dim:])
        assert not torch.allclose(ours[..., :rotary_dim], original[..., :rotary_dim])


def test_fp32_tables_rotate_bf16_in_fp32_as_olmo2_does() -> None:
    queries = torch.randn(2, 3, 24, HEAD_DIM).bfloat16()
    spec = RopeSpec.from_hf({}, HEAD_DIM, MAX_POSITIONS)
    cos, sin = rotary_tables(batch_positions(300), spec, torch.float32)
    expected, _ = olmo2_apply(queries, queries, cos[:, 0], sin[:, 0])
    ours = apply_rotary(queries, cos, sin)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected)


def short_long(count: int) -> dict[str, list[float]]:
    return {"short_factor": [1.0] * count, "long_factor": [2.0 + i for i in range(count)]}


TINY = {"hidden_size": 2 * HEAD_DIM, "num_attention_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 32, "vocab_size": 32}
# config.json as checkpoints from before transformers 5 carry it, and the spec it describes.
OLDER_FORMS: dict[str, tuple[dict[str, Any], dict[str, RopeSpec]]] = {
    "llama 3.1": (
        {"model_type": "llama", "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
        dict.fromkeys(("full_attention", "sliding_attention"), RopeSpec(
            "llama3", 500000.0, HEAD_DIM, factor=8.0, original_max_positions=8192,
            low_freq_factor=1.0, high_freq_factor=4.0))),
    "linear with type": (
        {"model_type": "llama", "max_position_embeddings": 4096,
         "rope_scaling": {"type": "linear", "factor": 2.0}},
        dict.fromkeys(("full_attention", "sliding_attention"),
                      RopeSpec("linear", 10000.0, HEAD_DIM, factor=2.0))),
    "dynamic with type": (
        {"model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 20000.0,
         "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        dict.fromkeys(("full_attention", "sliding_attention"), RopeSpec(
            "dynamic", 20000.0, HEAD_DIM, factor=2.0, original_max_positions=4096))),
    "qwen2.5 yarn": (
        {"model_type": "qwen2", "max_position_embeddings": 131072, "rope_theta": 1000000.0,
         "rope_scaling": {"type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 32768}},
        dict.fromkeys(("full_attention", "sliding_attention"), RopeSpec(
            "yarn", 1000000.0, HEAD_DIM, factor=4.0, original_max_positions=32768,
            attention_factor=0.1 * math.log(4.0) + 1))),
    "phi-3 longrope": (
        {"model_type": "phi3", "max_position_embeddings": 131072, "rope_theta": 10000.0,
         "original_max_position_embeddings": 4096,
         "rope_scaling": {"type": "longrope", **short_long(HEAD_DIM // 2)}},
        {}),
    "phi-4-mini partial": (
        {"model_type": "phi3", "max_position_embeddings": 131072, "rope_theta": 10000.0,
         "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
         "rope_scaling": {"type": "longrope", **short_long(HEAD_DIM * 3 // 8)}},
        {}),
    "gemma 3": (
        {"model_type": "gemma3_text", "head_dim": HEAD_DIM, "max_position_embeddings": 131072,
         "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
         "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
        {"full_attention": RopeSpec("linear", 1000000.0, HEAD_DIM, factor=8.0),
         "sliding_attention": RopeSpec("default", 10000.0, HEAD_DIM)}),
    "gemma 3 without bases": (
        {"model_type": "gemma3_text", "head_dim": HEAD_DIM, "max_position_embeddings": 131072},
        {"full_attention": RopeSpec("default", 1000000.0, HEAD_DIM),
         "sliding_attention": RopeSpec("default", 10000.0, HEAD_DIM)}),
    "mixtral without a base": (
        {"model_type": "mixtral", "max_position_embeddings": 32768},
        dict.fromkeys(("full_attention", "sliding_attention"),
                      RopeSpec("default", 1000000.0, HEAD_DIM))),
}


@pytest.mark.parametrize("name", list(OLDER_FORMS))
def test_older_config_forms_read_as_the_transformers_5_form(name: str) -> None:
    older, expected = OLDER_FORMS[name]
    # transformers' own config class turns the older form into its transformers-5 form.
    config = AutoConfig.for_model(**{**TINY, **older})
    current = config.to_dict()
    assert "rope_scaling" not in current and "rope_parameters" in current
    specs = rope_specs(older, HEAD_DIM)
    assert specs == rope_specs(current, HEAD_DIM)
    if expected:
        assert specs == expected
    if older["model_type"] == "phi3":
        spec = specs["full_attention"]
        assert (spec.kind, spec.original_max_positions) == ("longrope", 4096)
        assert spec.rotary_dim == int(HEAD_DIM * older.get("partial_rotary_factor", 1.0))
        # No factor given: max / original = 32 stands for it.
        assert spec.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))


def test_a_multimodal_gemma3_config_reads_its_text_config() -> None:
    text, expected = OLDER_FORMS["gemma 3"]
    assert rope_specs({"model_type": "gemma3", "text_config": text}, HEAD_DIM) == expected
    without_type = {key: value for key, value in text.items() if key != "model_type"}
    assert rope_specs({"model_type": "gemma3", "text_config": without_type}, HEAD_DIM) == expected


def test_phi3_su_is_longrope_under_its_old_name() -> None:
    """transformers 5.23 itself refuses "su" (its validation runs before the rename), so the
    reference is the same config saying longrope."""
    longrope, _ = OLDER_FORMS["phi-3 longrope"]
    su = {**longrope, "rope_scaling": {**longrope["rope_scaling"], "type": "su"}}
    assert rope_specs(su, HEAD_DIM) == rope_specs(longrope, HEAD_DIM)


@pytest.mark.parametrize(("params", "message"), [
    ({"rope_type": "ntk-by-parts", "factor": 2.0},
     ("'ntk-by-parts' is not supported; supported types: default, linear, dynamic, yarn, "
      "llama3, longrope")),
    ({"rope_type": "linear"}, "RoPE type 'linear' needs 'factor'"),
    ({"rope_type": "dynamic", "factor": None}, "RoPE type 'dynamic' needs 'factor'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "'yarn' needs 'factor'"),
    ({"rope_type": "linear", "factor": 0}, "'factor' must be a positive number, got 0"),
    ({"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "'factor' must be a positive number, got -8.0"),
    ({"rope_type": "linear", "factor": "2"}, "'factor' must be a positive number, got '2'"),
    ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
     "'llama3' needs 'low_freq_factor'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "high_freq_factor > low_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 31, "long_factor": [1.0] * 32},
     "'short_factor' has 31 entries; it needs one per rotated frequency, 32"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [1.0] * 33},
     "'long_factor' has 33 entries; it needs one per rotated frequency, 32"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32}, "'longrope' needs 'long_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 31 + [0.0], "long_factor": [1.0] * 32},
     "'short_factor' must be a list of positive numbers"),
    ({"partial_rotary_factor": 0.3}, "gives 19 rotated dims; it must be an even number"),
    ({"rope_theta": -1.0}, "'rope_theta' must be a positive number"),
    ({"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 2 / HEAD_DIM},
     "'dynamic' needs more than 2 rotated dims"),
])
def test_malformed_ropes_are_refused_naming_the_problem(params: dict[str, Any],
                                                        message: str) -> None:
    with pytest.raises(RopeConfigError, match=message.replace("[", r"\[")) as refusal:
        RopeSpec.from_hf(params, HEAD_DIM, MAX_POSITIONS)
    assert isinstance(refusal.value, ValueError)


def test_configs_without_needed_lengths_or_with_a_null_layer_type_are_refused() -> None:
    with pytest.raises(RopeConfigError, match="'dynamic' needs a positive whole max_position"):
        rope_specs({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                   HEAD_DIM)
    with pytest.raises(RopeConfigError, match="needs 'original_max_position_embeddings'"):
        rope_specs({"model_type": "llama", "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}}, HEAD_DIM)
    with pytest.raises(RopeConfigError, match=r"rope_parameters\['sliding_attention'\] must be"):
        rope_specs({"model_type": "olmo3", "max_position_embeddings": 64, "rope_parameters": {
            "full_attention": {"rope_type": "default"}, "sliding_attention": None}}, HEAD_DIM)
    with pytest.raises(RopeConfigError, match="must be a dict"):
        rope_specs({"model_type": "llama", "rope_scaling": [2.0]}, HEAD_DIM)


def test_a_nested_config_gives_the_layer_types_it_names() -> None:
    specs = rope_specs({"model_type": "qwen3", "max_position_embeddings": 64, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0}}}, HEAD_DIM)
    assert specs == {"full_attention": RopeSpec("linear", 10000.0, HEAD_DIM, factor=2.0)}


def test_which_tables_depend_on_the_length() -> None:
    dependent = {name for name, params in LLAMA_ROPES.items()
                 if RopeSpec.from_hf(params, HEAD_DIM, MAX_POSITIONS).depends_on_length}
    assert dependent == {"dynamic"}
    assert rope_specs(phi3_config("longrope", 1.0).to_dict(), HEAD_DIM)[
        "full_attention"].depends_on_length

