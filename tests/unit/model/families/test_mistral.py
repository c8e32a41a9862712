"""Mistral against transformers (conformance.py): every layer attends through a sliding window
shorter than the batch's rows."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("mistral", {"sliding_window": 4})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestMistral(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert spec.layer_types == ("sliding_attention",) * 4 and spec.sliding_window == 4
    assert not (spec.qkv_bias or spec.o_bias or spec.mlp_bias)
