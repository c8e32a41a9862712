"""SmolLM3 against transformers (conformance.py): every second layer without RoPE and sliding,
biases on q, k, v, o and the MLP, the family's default RoPE theta."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase

CASES = [FamilyCase("smollm3", {"no_rope_layer_interval": 2, "use_sliding_window": True,
                                "sliding_window": 4, "attention_bias": True,
                                "mlp_bias": True})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestSmolLM3(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert spec.no_rope_layers == {1, 3}
    assert spec.layer_types == ("full_attention", "sliding_attention") * 2
    assert spec.rope_of(1) is None and spec.rope_of(0) is not None
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, True, True)
