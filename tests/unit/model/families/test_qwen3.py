"""Qwen3 against transformers (conformance.py): q/k norms over head_dim, biases on q, k, v and o,
an explicit head_dim, Qwen2's sliding window on the last layer, and an untied head."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("qwen3", {"head_dim": 16, "attention_bias": True,
                              "tie_word_embeddings": False, "use_sliding_window": True,
                              "sliding_window": 5, "max_window_layers": 3})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestQwen3(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.qk_norm, spec.head_dim) == ("head", 16)
    assert (spec.qkv_bias, spec.o_bias) == (True, True)
    assert spec.layer_types == ("full_attention",) * 3 + ("sliding_attention",)
    assert "model.layers.0.self_attn.q_norm.weight" in family.model.tensors
    assert not spec.tie_word_embeddings and "lm_head.weight" in family.model.tensors
