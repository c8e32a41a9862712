"""Qwen2 / 2.5 against transformers (conformance.py): q/k/v biases without an o bias, and the
sliding window on the layers from max_window_layers on."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("qwen2", {"use_sliding_window": True, "sliding_window": 4,
                              "max_window_layers": 2})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestQwen2(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, False, False)
    assert spec.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert spec.sliding_window == 4
