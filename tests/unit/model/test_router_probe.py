"""Scoring a claimed routing against a stage's routers (model/moe.py routing_gaps, model/
router_probe.py): the router's own choice scores 0, a claim that swaps in a weaker expert scores
the logit gap between them, and the probe watching a real stage's forward scores each position
of each row, also where repeated rows ran once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.moe import FREE_ROUTE, routing_gaps
from decentrl.model.router_probe import RouterProbe
from decentrl.model.stages import StageCache, StageModule, StagePlan, build_stages
from decentrl.model.tiny import make_tiny_model
from tests.unit.model.families.test_qwen3_moe import CONFIG


def test_the_routers_own_choice_scores_zero_and_a_weaker_expert_its_gap() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0],
                           [0.5, 0.5, 0.0, 4.0],
                           [1.0, 2.0, 3.0, 4.0]])
    top = torch.topk(logits, 2).indices
    assert routing_gaps(logits, top).tolist() == [0.0, 0.0, 0.0]
    # Row 0: expert 3 (-1.0) in place of expert 2 (2.0, the 2nd best). Row 1: a tie at the 2nd
    # place (experts 0 and 1) either way is no gap. Row 2: the order of a claim does not matter.
    claimed = torch.tensor([[0, 3], [3, 1], [3, 2]])
    assert routing_gaps(logits, claimed).tolist() == [3.0, 0.0, 0.0]
    free = torch.tensor([[FREE_ROUTE, FREE_ROUTE], [3, 0], [0, 1]])
    assert routing_gaps(logits, free).tolist() == [0.0, 0.0, 2.0]


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> StageModule:
    """Stage 1 of two of a tiny Qwen3-MoE: two sparse layers."""
    folder = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe") / "model", seed=1,
                             model_type="qwen3_moe", **CONFIG)
    model: LoadedModel = load_model(str(folder))
    plan = StagePlan.even(model.spec.num_layers, 2)
    stages = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)
    return stages[1]


def probed(stage: StageModule, hidden: torch.Tensor, claimed: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(experts the forward chose, gaps of `claimed` or of those, router logits): a first step
    of a session, as a re-execution runs it."""
    batch, length = hidden.shape[:2]
    positions = torch.arange(length).expand(batch, length)
    valid = torch.ones((batch, length), dtype=torch.bool)
    cache = StageCache(stage.spec, len(stage.layers), batch, length, torch.float32,
                       torch.device("cpu"))
    with torch.inference_mode(), RouterProbe(stage) as probe:
        routed = stage.body_routed(hidden, positions, valid, cache)
        assert routed.experts is not None
        gaps = probe.gaps(routed.experts if claimed is None else claimed, hidden, positions,
                          valid)
        return routed.experts, gaps, probe.router_logits


def test_a_stage_scores_its_own_routing_zero_and_a_forgery_where_it_lies(
        stage: StageModule) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 6, stage.spec.hidden_size)
    hidden[2] = hidden[0]  # a repeated row: the first step runs it once
    experts, gaps, logits = probed(stage, hidden)
    assert experts.shape == (3, 6, 2, 2) and logits[0].shape[0] == 2  # distinct rows ran
    assert torch.equal(gaps, torch.zeros(3, 6))
    # Row 2, position 4, the stage's second sparse layer: the router's weakest expert in place of
    # its second best. Row 0, the same row of inputs, keeps the honest claim.
    forged = experts.clone()
    ranked = logits[1][0, 4].argsort(descending=True)  # row 2 ran as distinct row 0
    forged[2, 4, 1] = torch.stack([ranked[0], ranked[-1]]).to(forged.dtype)
    _, forged_gaps, _ = probed(stage, hidden, forged)
    expected = float(logits[1][0, 4, ranked[1]] - logits[1][0, 4, ranked[-1]])
    assert expected > 0
    assert forged_gaps[2, 4].item() == pytest.approx(expected)
    lied = torch.zeros((3, 6), dtype=torch.bool)
    lied[2, 4] = True
    assert torch.equal(forged_gaps[~lied], torch.zeros(17))


def test_a_probe_scores_one_forward(stage: StageModule) -> None:
    claimed = torch.zeros((1, 2, 2, 2), dtype=torch.int8)
    with RouterProbe(stage) as probe, pytest.raises(RuntimeError, match="one forward"):
        probe.gaps(claimed, torch.zeros(1, 2, 1), torch.zeros(1, 2), torch.ones(1, 2))
    # Its hooks are gone afterwards: a forward outside it leaves no logits behind.
    hidden = torch.randn(1, 2, stage.spec.hidden_size)
    with torch.inference_mode():
        stage.body(hidden, torch.arange(2)[None], torch.ones(1, 2, dtype=torch.bool))
    assert all(not calls for calls in probe._logits)


def test_a_dense_stage_has_nothing_to_score(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "model", seed=1, model_type="qwen3_moe", **CONFIG)
    model = load_model(str(folder))
    plan = StagePlan.even(model.spec.num_layers, 4)
    dense = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)[0]
    with RouterProbe(dense) as probe:
        assert probe.router_logits == []
