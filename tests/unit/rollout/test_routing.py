"""A rollout's recorded MoE routing: its record round-trips, a malformed one is refused where a
rollout is checked, a batch lays the records out for the learner (FREE_ROUTE where a row has
none), and a chain without experts refuses to record."""

from __future__ import annotations

import pytest
import torch

from decentrl.learn.batch import build_batch
from decentrl.model.loading import LoadedModel
from decentrl.model.moe import FREE_ROUTE
from decentrl.model.stages import StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate
from decentrl.rollout.routing import routing_record, routing_tensor
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout, RoutingRecord


def rollout(tokens: int, routing: RoutingRecord | None) -> Rollout:
    return Rollout(prompt_tokens=[1, 2], completion_tokens=list(range(3, 3 + tokens)),
                   behaviour_logprobs=[-0.5] * tokens, finished=True, routing=routing)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16])
def test_a_record_round_trips(dtype: torch.dtype) -> None:
    experts = torch.randint(0, 100, (5, 3, 2), generator=torch.Generator().manual_seed(0)
                            ).to(dtype)
    experts[-1] = FREE_ROUTE
    record = routing_record(experts)
    record.check(5)
    assert len(record.experts) == experts.numel() * experts.element_size()
    assert torch.equal(routing_tensor(record), experts)


@pytest.mark.parametrize(("record", "message"), [
    (RoutingRecord(layers=2, top_k=2, dtype="int8", experts=bytes(15)),
     r"holds 15 bytes; 4 tokens x 2 layers x 2 experts of int8 take 16"),
    (RoutingRecord(layers=2, top_k=2, dtype="int32", experts=bytes(64)),
     r"routing dtype 'int32' is not one of"),
    (RoutingRecord(layers=0, top_k=2, dtype="int8", experts=b""), r"layers and top_k >= 1"),
])
def test_a_malformed_record_is_refused(record: RoutingRecord, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rollout(4, record).check_lengths()


def test_a_batch_lays_out_the_records() -> None:
    first = torch.tensor([[[0, 1]], [[2, 3]], [[FREE_ROUTE, FREE_ROUTE]]], dtype=torch.int8)
    rows = [rollout(3, routing_record(first)), rollout(2, None)]
    batch = build_batch(rows, [1.0, -1.0], [0, 0], 0, demonstrations=[rollout(1, None)],
                        routing=True)
    assert batch.routing is not None and batch.routing.shape == (3, 3, 1, 2)
    assert torch.equal(batch.routing[0], first)
    assert bool((batch.routing[1:] == FREE_ROUTE).all())
    assert batch.select(slice(0, 1)).routing is not None
    assert build_batch(rows, [1.0, -1.0], [0, 0], 0).routing is None  # not asked: dropped
    wider = rollout(2, routing_record(torch.zeros(2, 2, 2, dtype=torch.int8)))
    with pytest.raises(ValueError, match=r"routing records disagree"):
        build_batch([rows[0], wider], [1.0, -1.0], [0, 0], 0, routing=True)


def test_a_dense_chain_refuses_to_record(tiny_model: LoadedModel) -> None:
    spec = tiny_model.spec
    stages = build_stages(spec, StagePlan.even(spec.num_layers, 1), tiny_model.tensors,
                          torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"record_routing needs a chain that records routing"):
        generate(LocalChain(stages), [[5, 6]], 3, SamplingConfig(), set(), 0,
                 record_routing=True)
