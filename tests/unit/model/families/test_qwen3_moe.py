"""Qwen3-MoE against transformers (conformance.py, moe_conformance.py): sparse layers of four
experts, top two without renormalisation, layer 0 a dense MLP (`mlp_only_layers`), Qwen3's q/k
norms and biases, a sliding window on every layer, an untied head; and `decentrl train` with
routing replay on its tiny model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decentrl.config import TrainConfig
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.stages import StagePlan, build_stage
from decentrl.rollout.sampling import SamplingConfig
from tests.unit.model.families.conformance import CPU, Conformance, Family, FamilyCase
from tests.unit.model.families.moe_conformance import MoEConformance

CONFIG = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
          "norm_topk_prob": False, "mlp_only_layers": [0], "head_dim": 16,
          "attention_bias": True, "use_sliding_window": True, "sliding_window": 5,
          "tie_word_embeddings": False}


CASES = [FamilyCase("qwen3_moe", CONFIG)]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request: pytest.FixtureRequest) -> FamilyCase:
    return request.param


class TestQwen3Moe(Conformance, MoEConformance):
    """conformance.py's and moe_conformance.py's tests on the `case` above."""


def test_reads_its_features(family: Family) -> None:
    spec = family.model.spec
    assert spec.moe is not None and spec.sparse_layers == {1, 2, 3}
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.expert_intermediate_size) == (4, 2, 24)
    assert not spec.moe.renormalises
    assert (spec.qk_norm, spec.head_dim, spec.qkv_bias, spec.o_bias) == ("head", 16, True, True)
    assert spec.layer_types == ("sliding_attention",) * 4 and spec.sliding_window == 5
    assert "model.layers.0.mlp.gate_proj.weight" in family.model.tensors
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in family.model.tensors


def test_routing_replay_refuses_a_dense_model(tiny_model: Any) -> None:
    plan = StagePlan.even(tiny_model.spec.num_layers, 1)
    stage = build_stage(tiny_model.spec, plan, 0, tiny_model.tensors, CPU, torch.float32)
    train = TrainConfig(routing_replay=True)
    with pytest.raises(ValueError, match=r"train.routing_replay needs a mixture-of-experts "
                                         r"model \(qwen3_moe, mixtral\); llama is dense"):
        PipelineTrainer.local([stage], train, loss_config_from(train, 8), SamplingConfig(),
                              torch.float32)
