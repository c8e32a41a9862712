"""Granite against transformers (conformance.py): its four multipliers (embedding, attention
scale, residual, logits divisor), none of them 1, biases on q, k, v, o and the MLP, and an untied
head."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("granite", {"tie_word_embeddings": False, "attention_bias": True,
                                "mlp_bias": True,
                                "embedding_multiplier": 3.0, "attention_multiplier": 0.3,
                                "residual_multiplier": 0.6, "logits_scaling": 2.5})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestGranite(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.embedding_multiplier, spec.attention_scale, spec.residual_multiplier,
            spec.logits_divisor) == (3.0, 0.3, 0.6, 2.5)
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, True, True)
    assert not spec.tie_word_embeddings
