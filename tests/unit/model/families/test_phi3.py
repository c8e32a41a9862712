"""Phi-3 / 3.5 against transformers (conformance.py): fused qkv_proj and gate_up_proj under their
checkpoint names, longrope RoPE with a partial rotary factor, a sliding window on every layer.
The harness's sequences stay within the original context (128), where longrope uses its short
factors; a forward past it (long factors) is checked against transformers' full forward below,
and a KV-cached session that could cross it is refused.
LoRA reaches the fused projections by their names, or by naming all of their parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from decentrl.config import LORA_TARGETS
from decentrl.model.families import spec_from_hf_config
from decentrl.model.lora import LoRALinear, add_lora
from decentrl.model.spec import UnsupportedModel
from decentrl.model.stages import StageModule, StagePlan
from tests.unit.model.families.conformance import (
    TOLERANCE,
    Conformance,
    Family,
    FamilyCase,
    build_family,
    chain_logits,
    relative_difference,
)

# head_dim 8, half of it rotated: two rotated frequencies, each with its own factors.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5], "long_factor": [3.0, 7.0]}
PHI3 = {"rope_parameters": LONGROPE, "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 128, "max_position_embeddings": 512,
        "sliding_window": 6, "tie_word_embeddings": False}


CASES = [FamilyCase("phi3", PHI3)]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestPhi3(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert spec.fused_projections and not spec.tie_word_embeddings
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
            } <= set(family.model.tensors)
    rope = spec.rope_of(0)
    assert (rope.kind, rope.rotary_dim, rope.original_max_positions, rope.factor) == \
        ("longrope", 4, 128, 4.0)
    assert spec.layer_types == ("sliding_attention",) * 4 and spec.sliding_window == 6
    assert max(family.valid.sum(1)) < rope.original_max_positions  # the short factors


def test_past_the_original_context_longrope_matches_transformers(tmp_path: Path) -> None:
    """With an original context of 8, the padded batch (14 positions) is past it: every position
    rotates by the long factors, in transformers' forward and in ours, at 1 to 4 stages."""
    family = build_family(FamilyCase("phi3", {**PHI3, "original_max_position_embeddings": 8}),
                          tmp_path)
    assert max(family.valid.sum(1)) > family.model.spec.rope_of(0).original_max_positions
    valid = family.valid
    for num_stages in range(1, 5):
        logits = chain_logits(family.stages(num_stages), family.ids, valid)
        assert relative_difference(logits[valid], family.expected[valid]) <= TOLERANCE


def test_sessions_past_the_original_context_are_refused(family: Family) -> None:
    """A KV-cached session that could cross the original context is refused when it opens: past
    it, longrope's long factors apply to every position, which keys cached under the short ones
    no longer match (transformers re-runs the whole prefix there; our stages cannot)."""
    stage = family.stages(2)[1]
    assert stage.new_cache(2, 128).max_length == 128
    with pytest.raises(ValueError, match=r"phi3: a KV-cached session of 129 positions would cross "
                                         r"original_max_position_embeddings \(128\)"):
        stage.new_cache(2, 129)


def test_lora_reaches_the_fused_projections_by_name(family: Family) -> None:
    """The default targets (every projection) put one adapter on each fused projection; naming
    it, or all of its parts, does the same; one part alone is refused, and so is a fused name on
    a family without it."""
    for targets in (LORA_TARGETS, ("qkv_proj", "gate_up_proj"),
                    ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj")):
        [stage] = family.stages(1)
        add_lora(stage, 2, 4.0, targets, seed=0)
        adapted = {name.rsplit(".", 2)[-1] for name, module in stage.named_modules()
                   if isinstance(module, LoRALinear)}
        assert adapted == {"qkv_proj", "gate_up_proj"} | (
            {"o_proj", "down_proj"} if targets == LORA_TARGETS else set())
    [stage] = family.stages(1)
    with pytest.raises(ValueError, match=r"'q_proj': phi3 fuses q_proj, k_proj, v_proj into one "
                                         r"projection, qkv_proj.*target 'qkv_proj'"):
        add_lora(stage, 2, 4.0, ("q_proj", "v_proj"), seed=0)
    with pytest.raises(ValueError, match=r"'up_proj': phi3 fuses gate_proj, up_proj"):
        add_lora(stage, 2, 4.0, ("up_proj",), seed=0)


def test_a_fused_target_on_a_family_without_it_is_refused() -> None:
    spec = spec_from_hf_config({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4})
    stage = StageModule(spec, StagePlan.even(spec.num_layers, 1), 0)
    with pytest.raises(ValueError, match=r"LoRA target 'qkv_proj': llama has no such projection; "
                                         r"its projections are \['q_proj', 'k_proj'"):
        add_lora(stage, 2, 4.0, ("o_proj", "qkv_proj"), seed=0)


@pytest.mark.parametrize("dropout", ["resid_pdrop", "embd_pdrop"])
def test_dropout_is_refused(family: Family, dropout: str) -> None:
    with pytest.raises(UnsupportedModel, match=rf"phi3: {dropout} 0.1 is not supported"):
        spec_from_hf_config({**family.model.hf_config, dropout: 0.1})
