"""Gemma 3 (text) against transformers (conformance.py): Gemma 2's decoder with (1 + weight)
q/k norms over head_dim, one full layer in two (`sliding_window_pattern`), a RoPE per layer type
(scaled on the full layers, its own base on the sliding ones); and a multimodal `gemma3` config
read through its text_config. (Soft-capping is Gemma 2's test's: Gemma 3 has none by default.)"""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
          "sliding_window_pattern": 2, "rope_parameters": ROPE}


CASES = [FamilyCase("gemma3_text", GEMMA3)]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestGemma3(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.norm_placement, spec.norm_kind, spec.qk_norm) == \
        ("sandwich", "rms_offset", "head")
    assert (spec.attention_scale, spec.attention_softcap, spec.final_logit_softcap) == \
        (24 ** -0.5, None, None)
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2
    full, sliding = spec.rope_of(1), spec.rope_of(0)
    assert (full.kind, full.theta, full.factor) == ("linear", 1000.0, 4.0)
    assert (sliding.kind, sliding.theta) == ("default", 50.0)
    assert "model.layers.0.self_attn.q_norm.weight" in family.model.tensors
