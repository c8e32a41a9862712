"""A training peer's checks on the routing a train_forward sends it to replay
(stage/inbound.py InboundChecks.routing) and a verifier's on the experts a verify_step asks it
to judge (InboundChecks.claimed_experts), and the RPC declarations that bound what an inference
reply, a training forward and a rollout submission may carry of a mixture of experts' routing
(net/protocol.py)."""

from __future__ import annotations

import pytest
import torch

from decentrl.model.families import spec_from_hf_config
from decentrl.model.moe import FREE_ROUTE
from decentrl.model.spec import ModelSpec
from decentrl.net.protocol import (
    INFERENCE_STEP,
    SUBMIT_ROLLOUTS,
    TRAIN_FORWARD,
    VERIFY_STEP,
)
from decentrl.net.sizes import MAX_SUBMISSION_BYTES, RunSizes, size_limit, step_reply_bytes
from decentrl.net.wire import WireError
from decentrl.stage.inbound import InboundChecks, PeerError

COMPLETIONS = torch.Size((2, 3))


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    """Four layers, layer 0 dense: stage 0 of two holds one sparse layer, stage 1 two."""
    return spec_from_hf_config({
        "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "max_position_embeddings": 64, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [0]})


def experts(*shape: int, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Distinct experts (0 and 1, then 2 and 3) for every token of `shape` [.., top_k = 2]."""
    base = torch.tensor([0, 1], dtype=dtype)
    return base.expand(*shape).clone()


def test_a_stage_replays_its_part_laid_out_as_the_whole_record(spec: ModelSpec) -> None:
    checks = InboundChecks(spec, 1, 2, 4096)
    sent = experts(2, 3, 2, 2)
    sent[0, 0] = FREE_ROUTE  # a token without a record routes freely
    whole = checks.routing(sent, COMPLETIONS)
    assert whole is not None and whole.shape == (2, 3, 3, 2)
    assert torch.equal(whole[:, :, 1:], sent)
    assert bool((whole[:, :, 0] == FREE_ROUTE).all())  # stage 0's layer: not this peer's
    assert checks.routing(None, COMPLETIONS) is None


@pytest.mark.parametrize(("stage", "sent", "error"), [
    (1, experts(2, 3, 2, 2, dtype=torch.int16), "routing must be torch.int8"),
    (1, experts(2, 3, 3, 2), r"routing must be \[2, 3, 2, 2\]"),
    (0, experts(2, 3, 2, 2), r"routing must be \[2, 3, 1, 2\]"),
    (1, experts(2, 4, 2, 2), r"routing must be \[2, 3, 2, 2\]"),
    (1, torch.full((2, 3, 2, 2), 4, dtype=torch.int8), "names expert 4"),
    (1, torch.zeros(2, 3, 2, 2, dtype=torch.int8), "twice"),
    (1, torch.tensor([FREE_ROUTE, 1], dtype=torch.int8).expand(2, 3, 2, 2).clone(), "mixes"),
])
def test_malformed_routing_is_the_senders_fault(spec: ModelSpec, stage: int,
                                                sent: torch.Tensor, error: str) -> None:
    with pytest.raises(PeerError, match=error):
        InboundChecks(spec, stage, 2, 4096).routing(sent, COMPLETIONS)


def test_a_stage_without_sparse_layers_refuses_routing(spec: ModelSpec) -> None:
    """Stage 0 of four holds layer 0 only, a dense MLP."""
    with pytest.raises(PeerError, match="stage 0 has no mixture-of-experts layer"):
        InboundChecks(spec, 0, 4, 4096).routing(experts(2, 3, 1, 2), COMPLETIONS)


def test_a_verifier_takes_claimed_experts_of_its_own_layers_only(spec: ModelSpec) -> None:
    checks = InboundChecks(spec, 1, 2, 4096)
    claimed = experts(2, 3, 2, 2)
    claimed[1, 2] = FREE_ROUTE  # no claim for that token
    assert checks.claimed_experts({"experts": claimed}, COMPLETIONS) is claimed
    assert checks.claimed_experts({}, COMPLETIONS) is None
    with pytest.raises(PeerError, match=r"experts must be \[2, 3, 2, 2\]"):
        checks.claimed_experts({"experts": experts(2, 3, 1, 2)}, COMPLETIONS)
    with pytest.raises(PeerError, match="experts: .*twice"):
        checks.claimed_experts({"experts": torch.zeros(2, 3, 2, 2, dtype=torch.int8)},
                               COMPLETIONS)
    with pytest.raises(PeerError, match="stage 0 has no mixture-of-experts layer to judge"):
        InboundChecks(spec, 0, 4, 4096).claimed_experts({"experts": experts(2, 3, 1, 2)},
                                                        COMPLETIONS)
    rule = VERIFY_STEP.tensors["experts"]
    assert not rule.required and rule.admits(torch.int8) and not rule.admits(torch.float32)
    VERIFY_STEP.check_reply_tensors({"hidden": torch.zeros(1), "routing_gaps": torch.zeros(1)})


def test_the_rpcs_take_routing_only_as_expert_indices() -> None:
    rule = TRAIN_FORWARD.tensors["routing"]
    assert not rule.required
    assert [rule.admits(dtype) for dtype in (torch.int8, torch.int16)] == [True, True]
    assert not any(rule.admits(dtype) for dtype in (torch.long, torch.float32, torch.uint8))
    INFERENCE_STEP.check_reply_tensors({"hidden": torch.zeros(1), "experts": torch.zeros(1)})
    with pytest.raises(WireError, match="carries no tensors"):
        INFERENCE_STEP.check_reply_tensors({"routing": torch.zeros(1)})


def test_a_step_reply_has_room_for_its_experts() -> None:
    sizes = RunSizes(16, 64, 4096, 4, routing_bytes=3 * 2 * 2)
    dense = RunSizes(16, 64, 4096, 4)
    assert step_reply_bytes(sizes) - step_reply_bytes(dense) >= 4096 * 12


def test_a_rollout_submission_has_room_for_its_routing_records() -> None:
    """A dense run's submissions keep MAX_SUBMISSION_BYTES; a mixture of experts' grow by a
    session's tokens of routing (Qwen3-30B-A3B: 48 sparse layers x 8 experts, int8)."""
    dense = RunSizes(2048, 4096, 65536, 8)
    routed = RunSizes(2048, 4096, 65536, 8, routing_bytes=48 * 8 * 2)
    assert size_limit(SUBMIT_ROLLOUTS.max_bytes, dense) == MAX_SUBMISSION_BYTES
    grown = size_limit(SUBMIT_ROLLOUTS.max_bytes, routed)
    assert grown is not None and grown >= MAX_SUBMISSION_BYTES + 65536 * 48 * 8
