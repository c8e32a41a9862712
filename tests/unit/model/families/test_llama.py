"""Llama 2 / 3.x against transformers (conformance.py): biases on q, k, v, o and the MLP, a
head_dim apart from hidden_size / heads; and Llama 3.x's `llama3` RoPE scaling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.model.rope import RopeSpec
from tests.unit.model.families.conformance import (
    TOLERANCE,
    Conformance,
    Family,
    FamilyCase,
    build_family,
    decode_sessions,
    padded_batch,
    relative_difference,
)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = [
    FamilyCase("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 16}, "llama2"),
    FamilyCase("llama", {"rope_parameters": LLAMA3_ROPE}, "llama3"),
]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestLlama(Conformance):
    """conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    bias = "attention_bias" in family.case.config
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (bias, bias, bias)
    assert spec.head_dim == family.case.config.get("head_dim", 8)
    assert all(isinstance(rope, RopeSpec) for rope in spec.rope.values())
    assert (spec.norm_placement, spec.qk_norm, spec.layer_types) == ("pre", "none", ())


def test_sessions_batched_under_a_length_dependent_rope_each_get_their_own_tables(
        tmp_path: Path) -> None:
    """Dynamic NTK RoPE chooses its frequencies from a forward's longest position: a session
    past max_position_embeddings (8) batched with one inside it must not change its tables."""
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    family = build_family(FamilyCase("llama", {"rope_parameters": dynamic,
                                               "max_position_embeddings": 8}), tmp_path)
    vocab = family.model.spec.vocab_size
    prompts = [padded_batch((10, 6), vocab, seed=1), padded_batch((4,), vocab, seed=2)]
    generator = torch.Generator().manual_seed(3)
    fed = [torch.randint(3, vocab, (ids.shape[0], 2), generator=generator) for ids, _ in prompts]
    stages = family.stages(2)
    together = decode_sessions(stages, prompts, fed, batched=True)
    alone = decode_sessions(stages, prompts, fed, batched=False)
    for got, one in zip(together, alone, strict=True):
        assert relative_difference(got, one) <= TOLERANCE
