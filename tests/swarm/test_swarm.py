"""The swarm layer end to end on loopback: stage peers (each its own SwarmNode, i.e. its own p2p
daemon, in this process; one test runs them as separate processes) serve inference sessions and
training steps that must give what the single-process chain and trainer give; peers split the
model; sessions survive a dead replica, a slow one and a lossy link; peers refuse malformed
requests with a message that says why and keep serving; inference replicas follow the weights
of their training peer."""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from helpers import build
from swarm_helpers import (
    ObservedChain,
    Swarm,
    call_raw,
    envelope,
    local_chain,
    local_trainer,
    publisher_of,
    serving,
    start_swarm,
    steps_through_infer,
    tiny_run_config,
    weights_of,
)

from decentrl.client import sessions
from decentrl.launch.adversary import unchecked_encoding
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import StageModule, StagePlan
from decentrl.net.link import LinkProfile
from decentrl.net.node import RemoteError
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    RPCS,
    TRAIN_DISCARD,
    TRAIN_FORWARD,
    ChunkRequest,
    CloseSession,
    Empty,
    InferenceReply,
    InferenceStep,
)
from decentrl.net.training_messages import CheckpointRequest, TrainBackward, TrainForward, TrainStep
from decentrl.net.wire import TensorLimits, TensorManifest, TensorSpec
from decentrl.rollout.chain import LocalChain, last_position
from decentrl.rollout.generate import Generation, generate
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout
from decentrl.stage.peer import StagePeer

# Every test here starts stage peers, each with its own p2p daemon.
pytestmark = pytest.mark.network

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40)
HELPERS = Path(__file__).parents[1]  # tests/, where swarm_peer_process.py lives


@pytest.fixture(scope="module")
def sharp(tiny_sharp_dir: Path) -> LoadedModel:
    return load_model(str(tiny_sharp_dir))


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries 10 ms apart instead of 0.2 s, 0.4 s, ...: the tests retry a lot on purpose."""
    monkeypatch.setattr(sessions, "backoff", lambda attempt: 0.01)


def run(chain: Any, sampling: SamplingConfig = GREEDY, seed: int | None = None,
        max_new_tokens: int = 10, stop_ids: set[int] = frozenset(),  # type: ignore[assignment]
        prompts: list[list[int]] = PROMPTS) -> list[Generation]:
    return generate(chain, prompts, max_new_tokens, sampling, set(stop_ids), 0, seed)


def tokens(generations: list[Generation]) -> list[list[int]]:
    return [g.tokens for g in generations]


def assert_same_generations(remote: list[Generation], local: list[Generation],
                            atol: float = 1e-5) -> None:
    assert tokens(remote) == tokens(local)
    assert [g.finished for g in remote] == [g.finished for g in local]
    for r, l in zip(remote, local):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(l.logprobs),
                                   atol=atol, rtol=0)


def make_batch(seed: int = 0, rows: int = 6, demonstrations: int = 0) -> TrainBatch:
    """`rows` made-up rollouts, then `demonstrations` made-up supervised rows whose last two
    completion tokens are an environment's."""
    g = torch.Generator().manual_seed(seed)
    rollouts = [Rollout(prompt_tokens=[1, 2, 3, i % 3 + 1],
                        completion_tokens=torch.randint(1, 30, (5 + i,), generator=g).tolist(),
                        behaviour_logprobs=[-1.0] * (5 + i), finished=True)
                for i in range(rows + demonstrations)]
    supervised = [msgspec.structs.replace(r, behaviour_logprobs=[0.0] * len(r.behaviour_logprobs),
                                          generated=[True] * (len(r.completion_tokens) - 2)
                                          + [False, False])
                  for r in rollouts[rows:]]
    advantages = [1.0, -1.0, 0.5, -0.5, 0.2, -0.2, 0.7, -0.7][:rows]
    return build_batch(rollouts[:rows], advantages, [0] * rows, 0, supervised)


# ---- 1. generation through a chain of peers equals the local chain -------------------------

@pytest.fixture(scope="module")
def chain3(tiny_sharp_dir: Path) -> Any:
    config = tiny_run_config(tiny_sharp_dir, 3)
    with start_swarm(config, [(0, "inference"), (1, "inference"), (2, "inference")]) as swarm:
        yield swarm


def test_three_stage_generation_matches_local_greedy_and_sampled(chain3: Swarm,
                                                                  sharp: LoadedModel) -> None:
    chain = chain3.chain(sharp.spec)
    assert [p.layers for p in chain3.peers] == [(0, 2), (2, 3), (3, 4)]
    local = local_chain(sharp, 3)
    expected = run(local)
    # The sharp model does not just repeat one token, so a broken cache or position would show.
    assert len({t for g in expected for t in g.tokens}) > 5
    got = run(chain)
    assert_same_generations(got, expected)
    assert all(g.versions == (0, 0, 0) for g in got)
    # A stop token ends one row early; the others keep going past it.
    stop = expected[0].tokens[1]
    stopped = run(chain, stop_ids={stop})
    assert_same_generations(stopped, run(local, stop_ids={stop}))
    first = expected[0].tokens.index(stop)
    assert stopped[0].finished and stopped[0].tokens == expected[0].tokens[:first + 1]
    assert any(not g.finished and len(g.tokens) == 10 for g in stopped)
    # Sampling: the same seed draws the same tokens on either chain, another seed does not.
    sampled = run(chain, SAMPLED, seed=7)
    assert_same_generations(sampled, run(local, SAMPLED, seed=7))
    assert tokens(sampled) != tokens(run(local, SAMPLED, seed=8))
    assert chain.failovers == 0
    # Every session was closed on every peer.
    assert all(not serving(p).sessions for p in chain3.peers)


def test_bf16_activations_keep_greedy_tokens_and_fp32_logprobs(tiny_sharp_dir: Path,
                                                               sharp: LoadedModel) -> None:
    """bf16 hidden states move the tiny model's log-probs by a few 1e-3 (5e-3 at most over 20
    tokens when this was written): far under its greedy margins, so the tokens must stay. The
    last stage sends its log-probs in fp32 whatever the activation codec (they are [B] floats,
    and the trainer's importance ratios need them exact)."""
    config = tiny_run_config(tiny_sharp_dir, 3, codec="bf16")
    with start_swarm(config, [(0, "inference"), (1, "inference"), (2, "inference")]) as swarm:
        got = run(swarm.chain(sharp.spec))
        expected = run(local_chain(sharp, 3))
        assert tokens(got) == tokens(expected)
        for r, l in zip(got, expected):
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(l.logprobs),
                                       atol=0.02, rtol=0)
        # The last stage alone, fed exact hidden states: its log-probs are exact and fp32.
        stages = build(sharp, 3)
        ids, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
        valid = torch.ones(1, 3, dtype=torch.bool)
        with torch.inference_mode():
            hidden = stages[1](stages[0](ids, positions, valid), positions, valid)
            logits = stages[2](hidden, positions, valid, head_positions=last_position(ids))
        _, out = swarm.client.call_sync(
            swarm.peer(2).node.peer_id, INFERENCE_STEP,
            InferenceStep(session="exact", start=0, batch=1, max_length=4, sampling=GREEDY),
            {"inputs": hidden, "positions": positions, "key_valid": valid})
        assert out["logprobs"].dtype == torch.float32
        assert out["tokens"].tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(out["logprobs"], logits.float().log_softmax(-1).max(-1).values,
                                   atol=1e-5, rtol=0)


# ---- 2. a pipeline training step over training peers equals the local trainer --------------

def test_remote_training_step_matches_local_trainer(tiny_model_dir: Path,
                                                    plain: LoadedModel) -> None:
    # A large learning rate so that a wrong gradient moves the weights visibly; a small gradient
    # clip so that the global norm across peers (and its scale) matters.
    config = tiny_run_config(tiny_model_dir, 2, train={"lr": 0.05, "max_grad_norm": 0.01})
    with start_swarm(config, [(0, "training"), (1, "training")]) as swarm:
        remote = swarm.remote_trainer()
        local = local_trainer(plain, config)
        before = [{k: v.clone() for k, v in t.stage.state_dict().items()}
                  for t in local.stage_trainers]
        # The second step has demonstrations beside the rollouts (supervised rows), in
        # micro-batches of both kinds.
        for step, (seed, demonstrations) in enumerate(((0, 0), (1, 3)), start=1):
            batch = make_batch(seed, demonstrations=demonstrations)
            got, expected = remote.train_step(batch), local.train_step(batch)
            assert set(got) == set(expected)
            assert got["grad_norm"] > config.train.max_grad_norm  # the clip is in play
            keys = ("policy_loss", "grad_norm", "entropy", "behaviour_kl",
                    *(("sft_nll", "sft_token_accuracy") if demonstrations else ()))
            for key in keys:
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
            assert [w.version for w in remote.workers] == [step, step]
            moved = 0.0
            for peer, trainer, initial in zip(swarm.peers, local.stage_trainers, before):
                assert peer.version == step and peer.training is not None
                remote_state = peer.training.model.state_dict()
                for name, value in trainer.stage.state_dict().items():
                    torch.testing.assert_close(remote_state[name], value, atol=1e-5, rtol=0)
                    moved = max(moved, float((value - initial[name]).abs().max()))
            assert moved > 1e-2  # the steps moved the weights far beyond the tolerance


# ---- 3. no peer holds the whole model ------------------------------------------------------

def test_peers_split_the_parameters(chain3: Swarm, sharp: LoadedModel) -> None:
    spec = sharp.spec
    with torch.device("meta"):
        whole = set(StageModule(spec, StagePlan.even(spec.num_layers, 1), 0).hf_names().values())
    names = [set(p.parameter_names()) for p in chain3.peers]
    assert all(n < whole for n in names)  # strict subsets
    assert set().union(*names) == whole
    assert set(sharp.tensors) <= whole and whole - set(sharp.tensors) <= {"lm_head.weight"}

    def layers(ns: set[str]) -> set[int]:
        return {int(n.split(".")[2]) for n in ns if n.startswith("model.layers.")}
    per_peer = [layers(n) for n in names]
    assert all(per_peer)
    assert sum(len(s) for s in per_peer) == len(set().union(*per_peer)) == spec.num_layers
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[2]
    assert not any(n.startswith(("model.embed", "lm_head", "model.norm")) for n in names[1])


# ---- 4. failover: sessions survive a dead replica and a slow one ----------------------------

def test_session_fails_over_to_another_replica(tiny_sharp_dir: Path, sharp: LoadedModel,
                                               fast_backoff: None) -> None:
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"request_timeout_s": 10.0})
    layout = [(0, "inference"), (1, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        killed: list[str] = []

        def kill_after_third_step(session: Any, step: int) -> None:
            if step == 2:
                killed.append(session.peers[1])
                swarm.kill(swarm.by_id(session.peers[1]))
        chain = ObservedChain(swarm.chain(sharp.spec), kill_after_third_step)
        got = run(chain)
        assert_same_generations(got, run(local_chain(sharp, 2)))
        (session,) = chain.sessions
        assert session.failovers >= 1
        assert session.peers[1] not in (None, killed[0])
        survivor = swarm.by_id(session.peers[1])
        # Closed at the end, after the replay rebuilt it there.
        assert not serving(survivor).sessions


def test_session_moves_to_a_replica_that_joined_after_it_started(
        tiny_sharp_dir: Path, sharp: LoadedModel, fast_backoff: None) -> None:
    """The stage's only replica dies and a new one joins: the session looks the new one up in
    the DHT rather than retrying the dead one (still announced, banned), and completes."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"request_timeout_s": 10.0})
    with start_swarm(config, [(0, "inference"), (1, "inference")]) as swarm:
        replacement: list[StagePeer] = []

        def replace_after_third_step(session: Any, step: int) -> None:
            if step == 2:
                swarm.kill(swarm.by_id(session.peers[1]))
                replacement.append(swarm.add(1, "inference"))
        chain = ObservedChain(swarm.chain(sharp.spec), replace_after_third_step)
        got = run(chain)
        assert_same_generations(got, run(local_chain(sharp, 2)))
        (session,) = chain.sessions
        assert session.failovers >= 1
        assert session.peers[1] == replacement[0].node.peer_id


def test_session_survives_a_timeout_on_its_only_replica(tiny_sharp_dir: Path,
                                                        sharp: LoadedModel,
                                                        fast_backoff: None) -> None:
    """The replica answers one step too late: the client gives up on that call and replays the
    session from position 0 to the same replica (the only one), which must rebuild the session
    it still holds rather than refuse the replay (a relayed session: the client calls every
    stage itself)."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"request_timeout_s": 2.0,
                                                       "avoid_failed_peer_s": 0.0,
                                                       "data_plane": "coordinator"})
    with start_swarm(config, [(0, "inference"), (1, "inference")]) as swarm:
        # The client's calls, watched for the one it gives up on.
        client_gave_up = threading.Event()
        real_call_sync = swarm.client.call_sync

        def watched_call_sync(*args: Any, **kwargs: Any) -> Any:
            try:
                return real_call_sync(*args, **kwargs)
            except RemoteError as error:
                if "no answer within" in str(error):
                    client_gave_up.set()
                raise
        swarm.client.call_sync = watched_call_sync  # type: ignore[method-assign]

        service = serving(swarm.peer(1))
        real_infer, calls = service.infer, []
        late_reply_followed_the_timeout: list[bool] = []

        def late_once(sender: str, body: InferenceStep, tensors: dict[str, torch.Tensor]) -> Any:
            calls.append(body.start)
            reply = real_infer(sender, body, tensors)
            if len(calls) == 3:
                # Answer only once the client has given up on this call: too late however fast
                # or slow the machine is. A deadlock guard, not a measurement: the client gives
                # up after request_timeout_s.
                late_reply_followed_the_timeout.append(client_gave_up.wait(timeout=120))
            return reply
        service.infer = late_once  # type: ignore[method-assign]
        steps_through_infer(service)
        chain = ObservedChain(swarm.chain(sharp.spec))
        got = run(chain, max_new_tokens=6)
        assert_same_generations(got, run(local_chain(sharp, 2), max_new_tokens=6))
        assert late_reply_followed_the_timeout == [True]
        # At least one timeout (more if the machine is slow) and a replay to the same replica.
        assert chain.sessions[0].failovers >= 1
        assert calls.count(0) >= 2  # the first step, and the replay after the timeout


# ---- 5. malformed, oversized and non-finite requests -----------------------------------------

LIMITS = TensorLimits(max_elements_per_tensor=4096, max_total_bytes=2**20)


@pytest.fixture(scope="module")
def guarded(tiny_sharp_dir: Path) -> Any:
    """Two peers that both serve inference and train, behind small tensor limits."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"max_sessions_per_peer": 4})
    with start_swarm(config, [(0, "both"), (1, "both")], limits=LIMITS) as swarm:
        for peer in swarm.peers:  # strikes never age out of the window while a case counts them
            peer.node.strike_book.clock = lambda: 0.0
        yield swarm


class Ctx:
    """What a malformed-request case needs: the client and the two peers' ids."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.p0, self.p1 = swarm.peer(0).node.peer_id, swarm.peer(1).node.peer_id
        self.hidden_size = swarm.peer(0).spec.hidden_size

    def call(self, peer: str, method: str, body: Any,
             tensors: dict[str, torch.Tensor] | None = None) -> Any:
        """`method` with `body` as it is: a hostile caller declares the RPC its own way (another
        body type), and the peer's own declaration refuses it."""
        rpc = replace(RPCS[method], request=type(body))
        return self.swarm.client.call_sync(peer, rpc, body, tensors, timeout=20)

    def raw(self, peer: str, method: str, body: Any, tensors: dict[str, torch.Tensor]) -> None:
        parts, manifest = unchecked_encoding(tensors)
        call_raw(self.swarm.client, peer, method, envelope(body, manifest), parts)

    def step0(self, session: str = "", start: int = 0, batch: int = 1, max_length: int = 8,
              **tensors: torch.Tensor) -> None:
        """Stage 0: tokens [[1, 2, 3]] unless given."""
        rows, n = tensors.get("inputs", torch.zeros(1, 3)).shape[:2]
        full = {"inputs": torch.tensor([[1, 2, 3]]),
                "positions": torch.arange(start, start + n).expand(rows, n),
                "key_valid": torch.ones(rows, start + n, dtype=torch.bool)} | tensors
        self.call(self.p0, "inference_step",
                  InferenceStep(session=session or secrets.token_hex(4), start=start, batch=batch,
                                max_length=max_length), full)

    def step1(self, sampling: SamplingConfig | dict[str, float] | None = GREEDY,
              raw: bool = False, **tensors: torch.Tensor) -> None:
        """Stage 1 (the last): hidden states of three positions unless given."""
        full = {"inputs": torch.randn(1, 3, self.hidden_size), "positions": torch.arange(3)[None],
                "key_valid": torch.ones(1, 3, dtype=torch.bool)} | tensors
        body = InferenceStep(session=secrets.token_hex(4), start=0, batch=1, max_length=8,
                             sampling=sampling)  # type: ignore[arg-type]  # a dict: unchecked
        if raw:
            self.raw(self.p1, "inference_step", body, full)
        else:
            self.call(self.p1, "inference_step", body, full)

    def train_tensors(self, stage: int, **changes: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = make_batch(rows=2)
        tensors = batch.tensors()
        if stage == 0:
            tensors["prompt_in"], tensors["completion_in"] = batch.prompts, batch.completions
        else:
            tensors["prompt_in"] = torch.randn(*batch.prompts.shape, self.hidden_size)
            tensors["completion_in"] = torch.randn(*batch.completions.shape, self.hidden_size)
        return tensors | changes

    def forward(self, stage: int, version: int = 0, micro: int = 50, raw: bool = False,
                **changes: torch.Tensor) -> None:
        body = TrainForward(micro=micro, version=version, last=stage == 1, total_sequences=2,
                            total_tokens=10)
        peer = self.p1 if stage == 1 else self.p0
        if raw:
            self.raw(peer, "train_forward", body, self.train_tensors(stage, **changes))
        else:
            self.call(peer, "train_forward", body, self.train_tensors(stage, **changes))


def open_then_step_at(ctx: Ctx, start: int, batch: int = 1) -> None:
    session = secrets.token_hex(4)
    ctx.step0(session)  # holds 3 positions now
    try:
        ctx.step0(session, start=start, batch=batch, inputs=torch.full((batch, 1), 4))
    finally:
        ctx.call(ctx.p0, "close_session", CloseSession(session=session))


def fill_up(ctx: Ctx) -> None:
    sessions = [secrets.token_hex(4) for _ in range(5)]
    try:
        for session in sessions:
            ctx.step0(session)
    finally:
        for session in sessions:
            ctx.call(ctx.p0, "close_session", CloseSession(session=session))


def oversized_message(ctx: Ctx) -> None:
    # 70 tensors of 4096 floats: each within the element limit, 1.1 MiB together.
    tensors = {f"t{i}": torch.zeros(4096) for i in range(70)}
    ctx.call(ctx.p0, "inference_step", InferenceStep(session="x", start=0, batch=1, max_length=8),
             tensors)


def lying_manifest(ctx: Ctx) -> None:
    parts, manifest = unchecked_encoding({"inputs": torch.tensor([[1, 2, 3]])})
    spec = manifest.tensors[0]
    bad = TensorManifest((TensorSpec(spec.name, spec.codec, spec.dtype, (1, 4), 1),))
    call_raw(ctx.swarm.client, ctx.p0, "inference_step",
             envelope(InferenceStep(session="x", start=0, batch=1, max_length=8), bad), parts)


BAD_REQUESTS: dict[str, tuple[Any, str]] = {
    # the body
    "garbage envelope": (lambda c: call_raw(c.swarm.client, c.p0, "inference_step",
                                            b"\x93\xc4\x03abc\x01garbage"),
                         "bad Envelope message"),
    "wrong struct": (lambda c: c.call(c.p0, "inference_step", CloseSession(session="x")),
                     r"bad InferenceStep message.*missing required field"),
    "garbage body": (lambda c: call_raw(c.swarm.client, c.p0, "inference_step",
                                        envelope(b"\xc1\xff\x00")), "bad InferenceStep message"),
    "wrong field type": (lambda c: c.call(c.p0, "inference_step", {
        "session": "x", "start": "zero", "batch": 1, "max_length": 8}),
        r"bad InferenceStep message.*Expected `int`"),
    "unknown field": (lambda c: c.call(c.p0, "inference_step", {
        "session": "x", "start": 0, "batch": 1, "max_length": 8, "admin": True}),
        r"bad InferenceStep message.*unknown field"),
    "missing tensor": (lambda c: c.call(c.p0, "inference_step", InferenceStep(
        session="x", start=0, batch=1, max_length=8), {"inputs": torch.tensor([[1]])}),
        r"needs tensors \['key_valid', 'positions'\]"),
    # the tensors
    "NaN hidden state": (lambda c: c.step1(raw=True, inputs=torch.full((1, 3, 32), float("nan"))),
                         "tensor 'inputs' has non-finite values"),
    "inf hidden state": (lambda c: c.step1(raw=True, inputs=torch.full((1, 3, 32), float("inf"))),
                         "tensor 'inputs' has non-finite values"),
    "wrong hidden size": (lambda c: c.step1(inputs=torch.randn(1, 3, 16)),
                          r"takes hidden states \[B, T, 32\], got torch.float32 \(1, 3, 16\)"),
    "token id over vocab": (lambda c: c.step0(inputs=torch.tensor([[1, 2, 81]])),
                            r"token ids must be in \[0, 81\)"),
    "negative token id": (lambda c: c.step0(inputs=torch.tensor([[1, -2, 3]])),
                          r"token ids must be in \[0, 81\)"),
    "float tokens": (lambda c: c.step0(inputs=torch.ones(1, 3)), "stage 0 takes token ids"),
    "key_valid too short": (lambda c: c.step0(key_valid=torch.ones(1, 2, dtype=torch.bool)),
                            r"key_valid must be bool \[1, 3\]"),
    "key_valid not bool": (lambda c: c.step0(key_valid=torch.ones(1, 3, dtype=torch.long)),
                           r"tensor key_valid must be bool, got torch.int64"),
    "position out of range": (lambda c: c.step0(positions=torch.tensor([[0, 1, 512]])),
                              r"positions must be in \[0, 512\)"),
    "positions wrong shape": (lambda c: c.step0(positions=torch.arange(4)[None]),
                              r"positions must be int64 \[1, 3\]"),
    # the session
    "start past the session": (lambda c: open_then_step_at(c, 5),
                               "holds 3 positions, the request starts at 5"),
    "start inside the session": (lambda c: open_then_step_at(c, 2),
                                 "holds 3 positions, the request starts at 2"),
    "batch unlike the session": (lambda c: open_then_step_at(c, 3, batch=2),
                                 "was opened with batch 1"),
    "unknown session": (lambda c: c.step0(start=4, inputs=torch.tensor([[1]]),
                                          key_valid=torch.ones(1, 5, dtype=torch.bool)),
                        r"unknown session .* replay it from position 0"),
    # A tiny request must not make the peer allocate a huge KV cache.
    "session too large": (lambda c: c.step0(batch=10**5),
                          r"batch 100000 x max_length 8 out of range .* <= 65536\)"),
    "max_length too large": (
        lambda c: c.step0(max_length=10**6),
        r"max_length 1000000 out of range \(max_length <= 512"),
    "inputs past max_length": (lambda c: c.step0(max_length=2), r"do not fit .* max_length 2"),
    "inputs unlike batch": (lambda c: c.step0(batch=2,
                                              key_valid=torch.ones(2, 3, dtype=torch.bool)),
                            "do not fit batch 2"),
    "peer is full": (fill_up, r"peer is full \(4 sessions\)"),
    # sampling at the last stage
    "no sampling": (lambda c: c.step1(sampling=None), "needs sampling parameters"),
    "bad sampling": (lambda c: c.step1(sampling={"temperature": 1.0, "top_p": 0.0}),
                     r"bad InferenceStep message: top_p must be in \(0, 1\]"),
    "NaN temperature": (lambda c: c.step1(sampling={"temperature": float("nan")}),
                        "bad InferenceStep message: temperature must be finite and >= 0, got nan"),
    "inf temperature": (lambda c: c.step1(sampling={"temperature": float("inf")}),
                        "bad InferenceStep message: temperature must be finite and >= 0, got inf"),
    # the receiving node's limits
    "tensor over the element limit": (lambda c: c.step1(inputs=torch.randn(1, 200, 32)),
                                      r"6400 elements .* over the limit of 4096"),
    "message over the byte limit": (oversized_message, r"over (the limit of )?1048576"),
    # the RPC's own declaration (net/protocol.py)
    "small request over its RPC's limit": (
        lambda c: c.call(c.p0, "close_session", CloseSession(session="x" * 70_000)),
        "close_session request over 65536 bytes"),
    "a tensor the RPC does not take": (
        lambda c: c.call(c.p0, "close_session", CloseSession(session="x"),
                         {"inputs": torch.zeros(1)}),
        r"close_session takes no tensors \['inputs'\]"),
    "manifest unlike the parts": (lying_manifest, r"shape expected \[1, 4\], got \[1, 3\]"),
    # training
    "train_forward at another version": (lambda c: c.forward(0, version=3),
                                         "stage 0 is at version 0, the request expects 3"),
    "train_forward batch tensor shape": (
        lambda c: c.forward(0, prompt_valid=torch.ones(2, 3, dtype=torch.bool)),
        r"batch tensor prompt_valid must be \(\d+, \d+\), got \(2, 3\)"),
    "train_forward batch tensor dtype": (
        lambda c: c.forward(0, advantages=torch.ones(2, dtype=torch.long)),
        r"train_forward tensor advantages must be float32, got torch.int64"),
    "train_forward missing tensors": (
        lambda c: c.call(c.p0, "train_forward", TrainForward(
            micro=0, version=0, last=False, total_sequences=2, total_tokens=10),
            {"prompts": torch.ones(1, 2, dtype=torch.long)}),
        r"train_forward needs tensors \['advantages', 'behaviour_logprobs'"),
    "train_forward token ids": (lambda c: c.forward(0, completions=torch.full((2, 6), 99)),
                                r"completions token ids must be in \[0, 81\)"),
    "train_forward wrong last": (
        lambda c: c.call(c.p0, "train_forward", TrainForward(
            micro=0, version=0, last=True, total_sequences=2, total_tokens=10),
            c.train_tensors(0)), "thinks stage 0 is the last stage"),
    "train_forward no sequences": (
        lambda c: c.call(c.p1, "train_forward", TrainForward(
            micro=0, version=0, last=True, total_sequences=0, total_tokens=0),
            c.train_tensors(1)), "total_sequences must be an int >= this micro-batch's 2"),
    "train_forward supervised shape": (
        lambda c: c.forward(0, supervised=torch.ones(3, dtype=torch.bool)),
        r"batch tensor supervised must be \(2,\), got \(3,\)"),
    "train_forward supervised tokens over the count": (
        lambda c: c.forward(1, supervised=torch.ones(2, dtype=torch.bool)),
        r"total_supervised_tokens 0 is below the micro-batch's \d+ supervised tokens"),
    "train_forward wrong hidden": (
        lambda c: c.forward(1, completion_in=torch.randn(2, 6, 16)),
        r"completion_in must be hidden states \(2, \d+, 32\)"),
    "train_forward NaN activations": (
        lambda c: c.forward(1, raw=True, prompt_in=torch.full((2, 4, 32), float("nan"))),
        "tensor 'prompt_in' has non-finite values"),
    "train_backward unknown micro": (lambda c: c.call(c.p0, "train_backward",
                                                      TrainBackward(micro=9)),
                                     "stage 0 has no forward pass for micro-batch 9"),
    "train_step at another version": (lambda c: c.call(c.p0, "train_step",
                                                       TrainStep(grad_scale=1.0, version=5)),
                                      "stage 0 is at version 0, the request expects 4"),
    "train_step bad grad_scale": (lambda c: c.call(c.p0, "train_step",
                                                   TrainStep(grad_scale=float("nan"), version=1)),
                                  r"grad_scale must be in \(0, 1\], got nan"),
    "sync_chunk of another stage": (lambda c: c.call(c.p0, "sync_chunk", ChunkRequest(
        stage=1, kind="delta", version=1, index=0, wait_s=0.0)),
                                    "this peer serves stage 0, not 1"),
    "sync_chunk that does not exist": (lambda c: c.call(c.p0, "sync_chunk", ChunkRequest(
        stage=0, kind="delta", version=3, index=0, wait_s=0.0)),
                                       "no chunk 0 of delta v3 of stage 0 here"),
    "sync_chunk past the last": (lambda c: c.call(c.p0, "sync_chunk", ChunkRequest(
        stage=0, kind="keyframe", version=0, index=10**6, wait_s=0.0)),
                                 r"keyframe v0 of stage 0 has chunks 0 to \d+, not 1000000"),
    "checkpoint that does not exist": (lambda c: c.call(c.p0, "checkpoint",
                                                        CheckpointRequest("load", 7)),
                                       "v7 has no stage0.pt"),
    "checkpoint of another version": (lambda c: c.call(c.p0, "checkpoint",
                                                       CheckpointRequest("save", 3)),
                                      "stage 0 is at version 0, the request expects 3"),
}


# The cases above that are well-formed requests the peer cannot serve in its present state (a
# session it does not hold, no room, another version: stage/inbound.py PeerBusy): no fault of the
# sender's, so no strike. Every other case is malformed, and a strike against its sender.
NOT_STRIKES = frozenset({
    "start past the session", "start inside the session", "unknown session", "peer is full",
    "train_forward at another version", "train_backward unknown micro",
    "train_step at another version", "sync_chunk that does not exist",
    "checkpoint that does not exist", "checkpoint of another version"})
assert NOT_STRIKES <= BAD_REQUESTS.keys()


def assert_serves(swarm: Swarm, stages: list[StageModule]) -> None:
    """Both peers still answer a correct inference step exactly, and stage 0 a training one."""
    client = swarm.client
    p0, p1 = swarm.peer(0).node.peer_id, swarm.peer(1).node.peer_id
    session = secrets.token_hex(4)
    ids, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    valid = torch.ones(1, 3, dtype=torch.bool)
    with torch.inference_mode():
        hidden = stages[0](ids, positions, valid)
        logits = stages[1](hidden, positions, valid, head_positions=last_position(ids))
    body = InferenceStep(session=session, start=0, batch=1, max_length=8)
    reply, out = client.call_sync(p0, INFERENCE_STEP, body,
                                  {"inputs": ids, "positions": positions, "key_valid": valid})
    assert reply == InferenceReply(version=0, length=3)
    torch.testing.assert_close(out["hidden"], hidden, atol=1e-5, rtol=0)
    body = InferenceStep(session=session, start=0, batch=1, max_length=8, sampling=GREEDY)
    _, out = client.call_sync(p1, INFERENCE_STEP, body,
                              {"inputs": hidden, "positions": positions, "key_valid": valid})
    assert out["tokens"].tolist() == logits.argmax(-1).tolist()
    for peer in (p0, p1):
        client.call_sync(peer, CLOSE_SESSION, CloseSession(session=session))
    assert all(not serving(p).sessions for p in swarm.peers)
    ctx = Ctx(swarm)
    batch = make_batch(rows=2)
    _, out = client.call_sync(p0, TRAIN_FORWARD, TrainForward(
        micro=0, version=0, last=False, total_sequences=2, total_tokens=10), ctx.train_tensors(0))
    assert out["completion_out"].shape == (*batch.completions.shape, 32)
    reply, _ = client.call_sync(p0, TRAIN_DISCARD, Empty())
    assert reply.version == 0
    assert all(p.version == 0 and p.training is not None and not p.training.trainer.saved
               for p in swarm.peers)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_peer_refuses_bad_request_and_keeps_serving(case: str, guarded: Swarm,
                                                    sharp: LoadedModel) -> None:
    send, message = BAD_REQUESTS[case]
    client = guarded.client.peer_id
    strikes = sum(peer.node.strikes(client) for peer in guarded.peers)
    with pytest.raises(RemoteError, match=message):
        send(Ctx(guarded))
    # A malformed request is a strike against its sender; a well-formed one the peer cannot
    # serve now (stage/inbound.py PeerBusy) is none.
    expected = 0 if case in NOT_STRIKES else 1
    assert sum(peer.node.strikes(client) for peer in guarded.peers) == strikes + expected
    assert_serves(guarded, build(sharp, 2))


# ---- 6. lost messages ----------------------------------------------------------------------

def test_generation_completes_over_a_lossy_link(tiny_sharp_dir: Path, sharp: LoadedModel,
                                                fast_backoff: None) -> None:
    """30% of the client's messages (requests and replies) are lost. Lost requests are sent
    again; lost replies are asked for again with the same request id and come from the peer's
    reply cache (a second run of the step would be refused: the session moved on)."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"retries": 30})
    link = LinkProfile(loss=0.3, seed=11)
    with start_swarm(config, [(0, "inference"), (1, "inference")], client_link=link) as swarm:
        runs = {p.node.peer_id: 0 for p in swarm.peers}
        for peer in swarm.peers:
            service = serving(peer)

            def counted(sender: str, body: Any, tensors: Any, peer: Any = peer,
                        real: Any = service.infer) -> Any:
                reply = real(sender, body, tensors)
                runs[peer.node.peer_id] += 1
                return reply
            service.infer = counted  # type: ignore[method-assign]
            steps_through_infer(service)
        stats: dict[str, Any] = {}
        chain = ObservedChain(swarm.chain(sharp.spec),
                              before_close=lambda s: stats.update(swarm.client.links.stats()))
        got = run(chain, max_new_tokens=12)
        assert_same_generations(got, run(local_chain(sharp, 2), max_new_tokens=12))
        assert chain.sessions[0].failovers == 0
        assert all(count == 12 for count in runs.values())  # each step ran once per stage
        assert sum(s.lost for s in stats.values()) > 0
        # Replies received beyond the steps run: retried requests answered from the cache.
        assert sum(stats[peer].messages_in - runs[peer] for peer in runs) > 0


# ---- 7. inference replicas follow their training peer's weights ------------------------------

def test_replica_follows_training_peer_weights(tiny_sharp_dir: Path, sharp: LoadedModel) -> None:
    # Dense updates: the replicas then hold the trainers' exact weights (sparse updates have
    # tests of their own in tests/swarm/test_sync.py).
    config = tiny_run_config(tiny_sharp_dir, 2, train={"lr": 0.05}, sync={"mode": "dense"})
    layout = [(0, "training"), (1, "training"), (0, "inference"), (1, "inference")]
    with start_swarm(config, layout) as swarm:
        replicas = [swarm.peer(s, "inference") for s in range(2)]
        trainers = [swarm.peer(s, "training") for s in range(2)]
        assert all(not r.node.run(weights_of(r).follow(), timeout=30) for r in replicas)  # v0
        swarm.remote_trainer().train_step(make_batch())
        assert [t.version for t in trainers] == [1, 1]
        for replica, trainer in zip(replicas, trainers):
            assert replica.version == 0 and trainer.training is not None
            publisher_of(trainer).wait(timeout=30)
            new = trainer.training.model.state_dict()
            served = serving(replica).model.state_dict()
            assert any(not torch.equal(v, new[k]) for k, v in served.items())
            assert replica.node.run(weights_of(replica).follow(), timeout=30) is True
            assert replica.version == 1
            for name, value in serving(replica).model.state_dict().items():
                assert torch.equal(value, new[name]), name
            assert replica.node.run(weights_of(replica).follow(), timeout=30) is False
        # The remote chain now generates with the new weights (and says so).
        directory = swarm.directory()
        assert {r.version for records in directory.stage_summary() for r in records} == {1}
        got = run(swarm.chain(sharp.spec))
        stages = [t.training.model for t in trainers if t.training is not None]
        expected = run(LocalChain(stages))
        assert_same_generations(got, expected)
        assert all(g.versions == (1, 1) for g in got)


# ---- 8. peers as separate processes ----------------------------------------------------------

def start_process(config_path: Path, stage: int, owner: str, addresses: list[str]
                  ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HELPERS / "swarm_peer_process.py"), str(config_path), str(stage),
         "inference", owner, *addresses],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_ready(process: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    assert process.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("READY "):
                return json.loads(line[len("READY "):])
    raise AssertionError(f"peer process did not start (exit code {process.poll()})")


def gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status  # a zombie: dead, waiting for its (new) parent to reap it


@pytest.mark.slow  # three fresh Python processes: 10 s on an idle 2-core machine, 20-50 s loaded
def test_peers_in_separate_processes(tiny_sharp_dir: Path, sharp: LoadedModel,
                                     tmp_path: Path, fast_backoff: None) -> None:
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"request_timeout_s": 10.0})
    config_path = tmp_path / "config.json"
    config_path.write_text(config.model_dump_json())
    processes: list[subprocess.Popen[str]] = []
    infos: list[dict[str, Any]] = []
    with start_swarm(config, []) as swarm:
        try:
            addresses = swarm.client.addresses()
            processes = [start_process(config_path, stage, swarm.client.peer_id, addresses)
                         for stage in (0, 1, 1)]
            deadline = time.monotonic() + 90
            infos = [read_ready(p, deadline) for p in processes]
            ids = [info["peer_id"] for info in infos]
            assert len(set(ids)) == 3
            local = run(local_chain(sharp, 2))
            chain = ObservedChain(swarm.chain(sharp.spec))
            assert_same_generations(run(chain), local)
            # kill -9 the replica of stage 1 the next session uses, in the middle of it.
            victims: list[int] = []

            def kill_mid_session(session: Any, step: int) -> None:
                if step == 3:
                    victim = ids.index(session.peers[1])
                    os.killpg(processes[victim].pid, signal.SIGKILL)
                    processes[victim].wait(10)
                    victims.append(victim)
            chain = ObservedChain(swarm.chain(sharp.spec), kill_mid_session)
            assert_same_generations(run(chain), local)
            assert chain.sessions[0].failovers >= 1
            (victim,) = victims
            # The whole process group is dead, p2pd included; its sockets stay behind.
            assert gone(infos[victim]["daemon_pid"])
            for path in infos[victim]["sockets"]:
                Path(path).unlink(missing_ok=True)
                assert not os.path.exists(path)
            # The others shut down cleanly on SIGTERM and remove their own sockets.
            for index, process in enumerate(processes):
                if index != victim:
                    process.send_signal(signal.SIGTERM)
                    assert process.wait(30) == 0
                    assert gone(infos[index]["daemon_pid"])
                    assert not any(os.path.exists(p) for p in infos[index]["sockets"])
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)
            for info in infos:
                for path in info["sockets"]:
                    Path(path).unlink(missing_ok=True)
