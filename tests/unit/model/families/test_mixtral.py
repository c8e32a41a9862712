"""Mixtral against transformers (conformance.py, moe_conformance.py): every layer a mixture of
four experts, top two renormalised, its checkpoint's `block_sparse_moe` names, Mistral's sliding
window, a tied head (untied by the stages)."""

from __future__ import annotations

import pytest

from tests.unit.model.families.conformance import Conformance, Family, FamilyCase
from tests.unit.model.families.moe_conformance import MoEConformance

CASES = [FamilyCase("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 6})]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestMixtral(Conformance, MoEConformance):
    """conformance.py's and moe_conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert spec.moe is not None and spec.sparse_layers == {0, 1, 2, 3}
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.renormalises) == (4, 2, True)
    assert spec.moe.expert_intermediate_size == spec.intermediate_size
    assert spec.layer_types == ("sliding_attention",) * 4 and spec.sliding_window == 6
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in family.model.tensors
    assert spec.tie_word_embeddings
