"""Routing replay over the swarm. Inference: a replica of a stage with mixture-of-experts layers
returns the experts its positions went to with every step, the session checks them (trust/relay.py
check_experts) and joins the stages' pieces in layer order, so that `generate(record_routing=True)`
over a RemoteChain records what a LocalChain records; a replica whose experts are malformed is
refused, blamed and banned like one with malformed activations. Training: each training peer is
sent its stage's part of the batch's routing and replays it. Spot checks: a group's claimed
experts are scored against the re-execution's routers, and a forged claim fails the replica that
served it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from swarm_helpers import local_chain, start_peer, start_swarm, tiny_run_config

from decentrl.client import sessions
from decentrl.client.sessions import RemoteChain
from decentrl.launch.adversary import HostileInference
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.moe import FREE_ROUTE
from decentrl.model.stages import StagePlan, routing_layers
from decentrl.model.tiny import make_tiny_model
from decentrl.net.node import Reply
from decentrl.net.protocol import InferenceStep
from decentrl.rollout.generate import generate, rollout_group
from decentrl.rollout.routing import routing_record, routing_tensor
from decentrl.rollout.sampling import SamplingConfig, sampling_config
from decentrl.rollout.types import RolloutGroup
from decentrl.stage.inbound import InboundChecks
from decentrl.stage.inference import InferenceService
from decentrl.stage.verification import VerifyService
from decentrl.trust.provenance import Provenance
from decentrl.trust.reputation import Reputation
from decentrl.trust.verify import Verifier
from tests.swarm.test_adversaries import coordinated
from tests.unit.model.families.test_mixtral import CASES as MIXTRAL_CASES
from tests.unit.model.families.test_qwen3_moe import CONFIG

(MIXTRAL,) = MIXTRAL_CASES

PROMPTS = [[1, 2, 3, 4], [5, 6], [1, 2, 3, 4]]  # a repeated prompt: its rows run once


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    folder = make_tiny_model(tmp_path_factory.mktemp("qwen3_moe") / "model", seed=1,
                             model_type="qwen3_moe", **CONFIG)
    return folder, load_model(str(folder))


@pytest.mark.network
@pytest.mark.parametrize(("model_type", "config", "sparse"), [
    ("qwen3_moe", CONFIG, [1, 2]),  # layers 0-1 (layer 0 dense) and 2-3
    ("qwen3_moe", CONFIG, [0, 1, 1, 1]),  # a dense stage replies no experts
    ("mixtral", MIXTRAL.config, [2, 2]),  # every layer sparse
])
def test_a_swarm_records_the_routing_a_local_chain_records(
        tmp_path: Path, model_type: str, config: dict[str, Any], sparse: list[int]) -> None:
    """Greedy: the same tokens and the same experts at every completion token as
    in-process."""
    folder = make_tiny_model(tmp_path / "model", seed=1, model_type=model_type, **config)
    model = load_model(str(folder))
    greedy = SamplingConfig(temperature=0.0)
    stages = len(sparse)
    expected = generate(local_chain(model, stages), PROMPTS, 5, greedy, set(), 0,
                        record_routing=True)
    layout = [(stage, "inference") for stage in range(stages)]
    with start_swarm(tiny_run_config(folder, stages), layout) as swarm:
        chain = swarm.chain(model.spec)
        assert chain.stage_sparse_layers == sparse
        got = generate(chain, PROMPTS, 5, greedy, set(), 0, record_routing=True)
    assert [g.tokens for g in got] == [g.tokens for g in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.routing is not None and theirs.routing is not None
        assert mine.routing.dtype == torch.int8 and mine.routing.shape[1:] == (sum(sparse), 2)
        assert torch.equal(mine.routing, theirs.routing)


class ForgedExperts(HostileInference):
    """An honest inference service whose replies' experts are replaced by `forge`'s (the
    adversaries' wrapper, lying about experts instead of activations)."""

    def __init__(self, service: InferenceService, forge: Any, from_position: int = 0) -> None:
        """`from_position`: the replies of steps starting there or later are forged."""
        super().__init__(service, "malformed-activations")
        self.forge, self.from_position = forge, from_position

    def _lie(self, body: InferenceStep, tensors: dict[str, torch.Tensor], reply: Reply
             ) -> Reply:
        if body.start < self.from_position:
            return reply
        result = dict(reply.tensors or {})
        result["experts"] = self.forge(result["experts"])
        self.malformed += 1
        return Reply(reply.body, result, reply.codec)


@pytest.mark.network
@pytest.mark.parametrize(("forge", "detail", "from_position"), [
    (lambda experts: experts[:, :, :, :1].contiguous(), r"experts must be \[3, 4, 1, 2\]", 0),
    (lambda experts: experts.to(torch.int16), "experts must be torch.int8", 0),
    (lambda experts: torch.zeros_like(experts), "twice", 0),
    (lambda experts: torch.full_like(experts, 9), "names expert 9", 0),
    # Mid-session: the honest replica taking over replays the session from position 0 and
    # replies every position's experts, of which the session keeps the step's.
    (lambda experts: torch.zeros_like(experts), "twice", 5),
])
def test_a_replica_replying_malformed_experts_is_refused_and_banned(
        qwen3_moe: tuple[Path, LoadedModel], monkeypatch: pytest.MonkeyPatch, forge: Any,
        detail: str, from_position: int) -> None:
    """The only stage-0 replica known at first forges its experts: the session refuses its
    reply (a proof in its reputation, a ban) and completes through an honest one, with the
    routing a local chain records. (Relayed through the coordinator, which checks every reply
    whole; peer to peer, the next stage refuses the push.)"""
    monkeypatch.setattr(sessions, "backoff", lambda attempt: 0.01)
    folder, model = qwen3_moe
    config = tiny_run_config(folder, 2, swarm={"retries": 3, "data_plane": "coordinator"})
    with start_swarm(config, [(1, "inference")]) as swarm:
        wrappers: list[ForgedExperts] = []

        def wrap(service: InferenceService) -> ForgedExperts:
            wrappers.append(ForgedExperts(service, forge, from_position))
            return wrappers[-1]
        hostile = start_peer(config, 0, "inference", swarm.client.addresses(),
                             swarm.client.peer_id, name="forger", wrap_inference=wrap)
        swarm.peers.append(hostile)
        swarm.sockets.extend(hostile.node.socket_paths())
        directory = swarm.directory()
        reputation = Reputation(config.trust.ban_score, config.trust.ban_s)
        directory.distrusted = reputation.banned
        chain = RemoteChain(swarm.client, directory, config.swarm, config.trust, model.spec,
                            reputation)
        swarm.add(0, "inference")
        greedy = SamplingConfig(temperature=0.0)
        got = generate(chain, PROMPTS, 3, greedy, set(), 0, record_routing=True)
    expected = generate(local_chain(model, 2), PROMPTS, 3, greedy, set(), 0,
                        record_routing=True)
    assert wrappers[0].malformed == 1
    assert reputation.banned(hostile.node.peer_id)
    (event,) = [e for e in reputation.events if e.peer == hostile.node.peer_id]
    assert (event.outcome, event.stage) == ("proved", 0)
    assert re.search(detail, event.detail), event.detail
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.routing is not None and torch.equal(mine.routing, theirs.routing)


@pytest.mark.network
def test_two_steps_of_qwen3_moe_with_routing_replay_through_a_swarm(
        qwen3_moe: tuple[Path, LoadedModel], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator records routing over the swarm and sends each training peer its stage's
    part, which the peer replays: every forward of both stages replays a record."""
    folder, _ = qwen3_moe
    replayed: list[tuple[int, tuple[int, ...]]] = []
    checked = InboundChecks.routing

    def spy(self: InboundChecks, sent: torch.Tensor | None, completions: torch.Size
            ) -> torch.Tensor | None:
        if sent is not None:  # a record, not routing left free everywhere
            assert bool((sent != FREE_ROUTE).any())
            replayed.append((self.stage, tuple(sent.shape[2:])))
        return checked(self, sent, completions)
    monkeypatch.setattr(InboundChecks, "routing", spy)
    config = tiny_run_config(
        folder, 2, host={"run_dir": str(tmp_path / "runs")},
        rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"steps": 2, "micro_batch_size": 4, "zero_variance_groups": "keep",
               "max_staleness": 2, "routing_replay": True},
        eval={"problems": 2, "pass_k": 1, "max_new_tokens": 4, "batch_size": 2,
              "greedy": False},
        swarm={"announce_every_s": 1.0, "avoid_failed_peer_s": 2.0})
    layout = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm, coordinated(config, swarm) as coordinator:
        summary = coordinator.run(wait_s=60)
    assert summary.steps == 2
    assert summary.banned == {}
    assert {stage for stage, _ in replayed} == {0, 1}
    assert {(0, (1, 2)), (1, (2, 2))} == set(replayed)


# ---- spot checks of the experts a replica claimed (trust/verify.py) -------------------------

# The tiny model's routers are nearly flat (logits of std ~0.1): honest fp32 replicas agree with
# the re-execution to rounding, a lie is a few hundredths of a nat off. No mismatch is allowed,
# so a single forged token fails the check.
CLAIM_TRUST = {"routing_tolerance": 1e-3, "max_mismatch_fraction": 0.0,
               "mismatched_tokens_allowed": 0}
GROUP_PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def claimed(qwen3_moe: tuple[Path, LoadedModel]
            ) -> Iterator[tuple[Verifier, RolloutGroup, Provenance]]:
    """A group of 4 sampled rows of one prompt with their routing recorded over a swarm of two
    inference replicas per stage, and a verifier that judges the experts of both stages."""
    folder, model = qwen3_moe
    config = tiny_run_config(folder, 2, trust=CLAIM_TRUST)
    layout = [(0, "inference"), (1, "inference"), (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        chain = swarm.chain(model.spec)
        sessions: list[Any] = []
        rows = generate(chain, [GROUP_PROMPT] * 4, 6, sampling_config(config.rollout), set(), 0,
                        seed=7, on_session=sessions.append, record_routing=True)
        group = rollout_group("claims/0", "claims", 0, GROUP_PROMPT, rows, 7)
        plan = StagePlan.even(model.spec.num_layers, 2)
        verifier = Verifier(swarm.client, chain.directory, config, model.spec.hidden_size, 0,
                            [routing_layers(model.spec, plan.layers(s)) for s in range(2)])
        yield verifier, group, sessions[0].provenance


def forged_group(group: RolloutGroup, row: int, token: int, layer: int) -> RolloutGroup:
    """`group` with row `row`'s record of completion token `token` in sparse layer `layer`
    naming other experts: the two the honest record left out (4 experts, top-2)."""
    rollout = group.rollouts[row]
    assert rollout.routing is not None
    record = routing_tensor(rollout.routing).clone()
    honest = set(record[token, layer].tolist())
    record[token, layer] = torch.tensor(sorted(set(range(4)) - honest), dtype=record.dtype)
    rollouts = list(group.rollouts)
    rollouts[row] = msgspec.structs.replace(rollout, routing=routing_record(record))
    return msgspec.structs.replace(group, rollouts=rollouts)


@pytest.mark.network
def test_honest_claimed_experts_pass_their_spot_check(claimed: Any) -> None:
    verifier, group, provenance = claimed
    verdict = verifier.verify(group, provenance, verifier.panel(provenance))
    assert verdict.outcome == "passed", verdict
    assert verdict.checked == (0, 1)
    # Every fed completion token's claim was scored at both stages (the last token is never fed).
    fed = sum(len(r.completion_tokens) - 1 for r in group.rollouts)
    assert verdict.routing_gaps is not None and verdict.routing_gaps.numel() == 2 * fed
    assert float(verdict.routing_gaps.max()) <= CLAIM_TRUST["routing_tolerance"]


@pytest.mark.network
@pytest.mark.parametrize(("layer", "stage"), [(0, 0), (2, 1)])
def test_a_forged_claim_of_experts_fails_the_replica_that_served_it(
        claimed: Any, layer: int, stage: int) -> None:
    """Sparse layer 0 is stage 0's (layer 1 of the model), sparse layer 2 stage 1's (layer 3):
    one token's claim forged there fails that stage, blamed on the replica that served the
    token's column; the re-executed activations were honest (no sketch failed)."""
    verifier, group, provenance = claimed
    forged = forged_group(group, row=2, token=3, layer=layer)
    verdict = verifier.verify(forged, provenance, verifier.panel(provenance))
    assert verdict.outcome == "failed", verdict
    assert verdict.stage == stage
    column = len(GROUP_PROMPT) + 3  # token 3 was fed there (the session of this group alone)
    assert verdict.peer == provenance.stages[stage].peer_at(column)
    assert f"stage {stage}: 1 of" in verdict.detail and "claimed experts" in verdict.detail


@pytest.mark.network
def test_a_verifier_replying_malformed_routing_gaps_is_not_believed(
        claimed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative gaps (or any malformed ones) are not a ruling: the check is skipped, nobody is
    blamed on them."""
    verifier, group, provenance = claimed
    honest = VerifyService._reexecute

    def negative_gaps(self: VerifyService, sender: str, body: Any,
                      tensors: dict[str, torch.Tensor]) -> Reply:
        reply = honest(self, sender, body, tensors)
        exact, scores = dict(reply.exact or {}), dict(reply.tensors or {})
        for found in (exact, scores):
            if "routing_gaps" in found:
                found["routing_gaps"] = -torch.ones_like(found["routing_gaps"])
        return Reply(reply.body, scores, reply.codec, exact or None)
    monkeypatch.setattr(VerifyService, "_reexecute", negative_gaps)
    verdict = verifier.verify(group, provenance, verifier.panel(provenance))
    assert verdict.outcome == "skipped", verdict
    assert "routing gaps" in verdict.detail and verdict.peer is None
