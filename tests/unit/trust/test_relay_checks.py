"""The coordinator checks every tensor an inference stage replies, whole, before it uses it or
relays it to the next stage (trust/relay.py): a hostile stage-0 replica that returns hidden states
of the wrong width, NaNs or huge values is refused, blamed and banned; the honest next stage never sees its reply, so it never strikes the coordinator; the
session fails over to an honest replica and generation completes as it would have locally."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from swarm_helpers import local_chain, start_peer, start_swarm, tiny_run_config

from decentrl.client import push_sessions, sessions
from decentrl.client.sessions import RemoteChain
from decentrl.launch.adversary import MALFORMATIONS, HostileInference
from decentrl.model.loading import load_model
from decentrl.model.moe import FREE_ROUTE, MoESpec
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inference import InferenceService
from decentrl.trust.relay import (
    MAX_ACTIVATION,
    BadReply,
    check_experts,
    check_hidden_states,
    check_samples,
)
from decentrl.trust.reputation import Reputation

BATCH, LENGTH, HIDDEN, VOCAB = 2, 3, 8, 50


@pytest.mark.parametrize(("hidden", "error"), [
    (None, r"no hidden states \[2, 3, 8\]"),
    (torch.zeros(BATCH, LENGTH, HIDDEN, dtype=torch.long), "must be floating"),
    (torch.zeros(BATCH, LENGTH, HIDDEN // 2), r"must be \[2, 3, 8\], got \[2, 3, 4\]"),
    (torch.zeros(BATCH, LENGTH + 1, HIDDEN), r"must be \[2, 3, 8\], got \[2, 4, 8\]"),
    (torch.zeros(BATCH, LENGTH, HIDDEN).index_fill(2, torch.tensor([1]), float("nan")),
     "non-finite"),
    (torch.full((BATCH, LENGTH, HIDDEN), -float("inf")), "non-finite"),
    (torch.full((BATCH, LENGTH, HIDDEN), 2 * MAX_ACTIVATION), "over the bound"),
    (torch.full((BATCH, LENGTH, HIDDEN), 2 * MAX_ACTIVATION, dtype=torch.bfloat16),
     "over the bound"),
])
def test_relayed_hidden_states_are_refused_unless_whole_and_bounded(
        hidden: torch.Tensor | None, error: str) -> None:
    with pytest.raises(BadReply, match=error):
        check_hidden_states(hidden, BATCH, LENGTH, HIDDEN)


def test_honest_hidden_states_pass_up_to_the_bound() -> None:
    """SmolLM2's massive activations (~25,000) and the bound itself pass, in fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(BATCH, LENGTH, HIDDEN).to(dtype)
        hidden[0, 0, 0], hidden[1, 0, 3] = 24_960.0, -MAX_ACTIVATION
        assert check_hidden_states(hidden, BATCH, LENGTH, HIDDEN) is hidden


@pytest.mark.parametrize(("tokens", "logprobs", "error"), [
    (None, torch.zeros(BATCH), "must reply tokens and logprobs"),
    (torch.zeros(BATCH, dtype=torch.int32), torch.zeros(BATCH), "tokens must be int64"),
    (torch.zeros(BATCH + 1, dtype=torch.long), torch.zeros(BATCH), r"tokens must be int64 \[2\]"),
    (torch.tensor([0, VOCAB]), torch.zeros(BATCH), r"in \[0, 50\)"),
    (torch.tensor([-1, 0]), torch.zeros(BATCH), r"in \[0, 50\)"),
    (torch.tensor([0, 1]), torch.zeros(BATCH, dtype=torch.long), "logprobs must be floating"),
    (torch.tensor([0, 1]), torch.zeros(BATCH, 1), r"logprobs must be floating \[2\]"),
    (torch.tensor([0, 1]), torch.tensor([-1.0, 0.5]), "finite and <= 0"),
    (torch.tensor([0, 1]), torch.tensor([-1.0, float("nan")]), "finite and <= 0"),
    (torch.tensor([0, 1]), torch.tensor([-float("inf"), -1.0]), "finite and <= 0"),
])
def test_sampled_tokens_and_logprobs_are_refused_unless_valid(
        tokens: torch.Tensor | None, logprobs: torch.Tensor, error: str) -> None:
    with pytest.raises(BadReply, match=error):
        check_samples(tokens, logprobs, BATCH, VOCAB)


def test_valid_samples_pass_with_fp32_logprobs() -> None:
    tokens, logprobs = check_samples(torch.tensor([0, VOCAB - 1]),
                                     torch.tensor([0.0, -3.5], dtype=torch.bfloat16), BATCH, VOCAB)
    assert tokens.tolist() == [0, VOCAB - 1] and logprobs.dtype == torch.float32


def moe_spec() -> MoESpec:
    return MoESpec(family="qwen3_moe", hidden_size=8, expert_intermediate_size=4, num_experts=4,
                   top_k=2, norm_topk_prob=False, activation="silu")


@pytest.mark.parametrize(("experts", "error"), [
    (None, r"no experts \[2, 3, 1, 2\]"),
    (torch.zeros(2, 3, 1, 2, dtype=torch.long), "must be torch.int8"),
    (torch.zeros(2, 3, 2, 2, dtype=torch.int8), r"must be \[2, 3, 1, 2\], got \[2, 3, 2, 2\]"),
    (torch.full((2, 3, 1, 2), 4, dtype=torch.int8), "names expert 4"),
    (torch.zeros(2, 3, 1, 2, dtype=torch.int8), "twice"),
    (torch.full((2, 3, 1, 2), FREE_ROUTE, dtype=torch.int8), "name no expert"),
])
def test_replied_experts_are_refused_unless_distinct_experts_of_the_declared_shape(
        experts: torch.Tensor | None, error: str) -> None:
    with pytest.raises(BadReply, match=error):
        check_experts(experts, 2, 3, 1, moe_spec())


def test_honest_experts_pass() -> None:
    experts = torch.tensor([[0, 3], [2, 1], [3, 2]], dtype=torch.int8).reshape(1, 3, 1, 2)
    assert check_experts(experts, 1, 3, 1, moe_spec()) is experts


@pytest.mark.network
@pytest.mark.parametrize("plane", ["coordinator", "peer_to_peer"])
def test_malformed_activations_are_refused_and_proved_against_their_producer(
        plane: str, tiny_sharp_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three hostile stage-0 replicas, one per malformation, are the only stage-0 replicas the
    coordinator knows when generation starts; an honest one joins after. The session tries each
    hostile replica in turn, bans it with a proof in its reputation, then finds the honest
    replica and completes. Relayed, the coordinator refuses the reply before the next stage
    gets it; peer to peer, the next stage refuses the push (a strike against its sender) and
    keeps it as signed, and the coordinator, told by the hostile replica that the next stage
    failed, asks the next stage for its evidence and finds the proof in what the hostile
    replica signed (net/evidence.py, trust/evidence.py)."""
    monkeypatch.setattr(sessions, "backoff", lambda attempt: 0.01)
    monkeypatch.setattr(push_sessions, "backoff", lambda attempt: 0.01)
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"retries": 6, "data_plane": plane})
    sharp = load_model(str(tiny_sharp_dir))
    with start_swarm(config, [(1, "inference")]) as swarm:
        hostile: dict[str, HostileInference] = {}

        def wrap(kind: str) -> Callable[[InferenceService], HostileInference]:
            return lambda service: hostile.setdefault(
                kind, HostileInference(service, "malformed-activations", malformation=kind))
        hostile_ids: dict[str, str] = {}
        for kind in MALFORMATIONS:
            peer = start_peer(config, 0, "inference", swarm.client.addresses(),
                              swarm.client.peer_id, name=f"hostile-{kind}",
                              wrap_inference=wrap(kind))
            swarm.peers.append(peer)  # shut down with the swarm
            swarm.sockets.extend(peer.node.socket_paths())
            hostile_ids[kind] = peer.node.peer_id
        directory = swarm.directory()  # knows the hostile replicas only
        reputation = Reputation(config.trust.ban_score, config.trust.ban_s)
        directory.distrusted = reputation.banned
        chain = RemoteChain(swarm.client, directory, config.swarm, config.trust, sharp.spec,
                            reputation)
        honest = swarm.add(0, "inference")
        next_stage = swarm.peer(1)
        strikes: list[tuple[str, str]] = []
        next_stage.node.on_strike = lambda peer, reason: strikes.append((peer, reason))

        prompts = [[1, 2, 3, 4], [5, 6]]
        greedy = SamplingConfig(temperature=0.0)
        got = generate(chain, prompts, 6, greedy, set(), 0)
        expected = generate(local_chain(sharp, 2), prompts, 6, greedy, set(), 0)

        assert [g.tokens for g in got] == [g.tokens for g in expected]
        assert chain.failovers == len(MALFORMATIONS)
        width = (r"hidden states must be \[2, 4, 32\], got \[2, 4, 16\]" if plane == "coordinator"
                 else r"stage 1 takes hidden states \[B, T, 32\], got torch.float32 \(2, 4, 16\)")
        details = {"wrong-width": width, "non-finite": "non-finite values",
                   "huge": "over the bound"}
        for kind, peer_id in hostile_ids.items():
            assert hostile[kind].malformed == 1  # it attacked once, and was never asked again
            assert reputation.banned(peer_id)
            (event,) = [e for e in reputation.events if e.peer == peer_id]
            assert (event.outcome, event.stage) == ("proved", 0)
            assert re.search(details[kind], event.detail), event.detail
        assert not reputation.banned(honest.node.peer_id)
        assert not reputation.banned(next_stage.node.peer_id)  # the accused, cleared
        # Relayed, the next stage never received a malformed tensor; peer to peer it struck
        # each hostile replica once. Never the coordinator.
        assert next_stage.node.strikes(swarm.client.peer_id) == 0
        assert sorted(peer for peer, _ in strikes) == (
            [] if plane == "coordinator" else sorted(hostile_ids.values()))
