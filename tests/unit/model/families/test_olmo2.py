"""OLMo 2 against transformers (conformance.py): norms on the sublayers' outputs, q/k norms over
the whole projection width, biases on q, k, v and o."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("olmo2", {"attention_bias": True})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestOlmo2(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.norm_placement, spec.norm_kind, spec.qk_norm) == ("post", "rms_fp32", "full")
    names = family.model.tensors
    assert "model.layers.0.post_feedforward_layernorm.weight" in names
    assert "model.layers.0.input_layernorm.weight" not in names
    assert names["model.layers.0.self_attn.k_norm.weight"].shape == (2 * spec.head_dim,)
