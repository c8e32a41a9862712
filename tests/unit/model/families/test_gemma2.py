"""Gemma 2 against transformers (conformance.py): sandwich norms scaling by (1 + weight), the
rounded sqrt(hidden_size) embedding scale, query_pre_attn_scalar, attention and final-logit
soft-caps that bite, sliding and full layers alternating, biases on q, k, v and o, a tanh-GELU
MLP and a tied head; each of those features changes the logits, so the match is not vacuous."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from decentrl.model.stages import StagePlan, build_stages
from tests.unit.model.families.conformance import (
    CPU,
    TOLERANCE,
    Conformance,
    Family,
    FamilyCase,
    chain_logits,
    relative_difference,
)

GEMMA2 = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "attention_bias": True}


CASES = [FamilyCase("gemma2", GEMMA2)]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestGemma2(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert (spec.norm_placement, spec.norm_kind, spec.hidden_act) == \
        ("sandwich", "rms_offset", "gelu_pytorch_tanh")
    assert (spec.attention_scale, spec.attention_softcap, spec.final_logit_softcap) == \
        (24 ** -0.5, 2.0, 3.0)
    assert (spec.embedding_multiplier, spec.embedding_multiplier_rounded) == (32 ** 0.5, True)
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2
    assert (spec.sliding_window, spec.qkv_bias, spec.o_bias, spec.mlp_bias) == \
        (4, True, True, False)
    assert spec.tie_word_embeddings and spec.qk_norm == "none"


@pytest.mark.parametrize("change", [
    {"attention_softcap": None}, {"final_logit_softcap": None}, {"attention_scale": None},
    {"layer_types": ()}, {"norm_kind": "rms"}, {"embedding_multiplier": 1.0}])
def test_each_feature_changes_the_logits(family: Family, change: dict[str, object]) -> None:
    """Without any one of Gemma's features, the model computes something else: the match with
    transformers tests each of them."""
    spec = replace(family.model.spec, **change)
    stages = build_stages(spec, StagePlan.even(spec.num_layers, 1), family.model.tensors, CPU,
                          torch.float32)
    valid = family.valid
    logits = chain_logits(stages, family.ids, valid)
    assert relative_difference(logits[valid], family.expected[valid]) > 100 * TOLERANCE


def test_embedding_scale_is_rounded_to_the_compute_dtype(family: Family) -> None:
    """In bf16, sqrt(hidden_size) is rounded to bf16 before it scales the embeddings, as
    transformers keeps it: stage 0's embeddings equal transformers' bit for bit."""
    [stage] = build_stages(family.model.spec, StagePlan.even(family.model.spec.num_layers, 1),
                           family.model.tensors, CPU, torch.bfloat16)
    theirs = copy.deepcopy(family.hf.model.embed_tokens).to(torch.bfloat16)
    with torch.no_grad():
        expected = theirs(family.ids)
        assert torch.equal(stage.embed(family.ids), expected)
        unrounded = stage.embed_tokens(family.ids) * family.model.spec.embedding_multiplier
        assert not torch.equal(unrounded, expected)
