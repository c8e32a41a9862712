"""Inference sessions on a stage peer (stage/inference.py): a session belongs to the peer that
opened it, so another caller using the same id can neither step, replay over nor close it; the
KV caches grow with the positions written (model/blocks.py LayerCache) instead of being allocated
for max_length up front; and a per-sender budget of sessions and cached tokens refuses the extra
with PeerBusy (no strike)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build
from swarm_helpers import Swarm, serving, start_node, start_swarm, tiny_run_config

from decentrl.config import ConfigError
from decentrl.model.blocks import KV_GROWTH, LayerCache
from decentrl.model.loading import load_model
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    CloseSession,
    InferenceStep,
    Rpc,
)
from decentrl.net.wire import TensorLimits

CPU = torch.device("cpu")


# ---- the cache alone --------------------------------------------------------------------------

def test_layer_cache_grows_in_chunks_as_positions_are_written_never_past_max_length() -> None:
    max_length = 2 * KV_GROWTH + 10
    cache = LayerCache(3, 2, max_length, 4, torch.float32, CPU)
    assert cache.capacity == 0 and cache.keys.nbytes == 0
    written = torch.randn(3, 2, max_length, 4)
    for start, end, capacity in [(0, 5, KV_GROWTH), (5, KV_GROWTH, KV_GROWTH),
                                 (KV_GROWTH, KV_GROWTH + 1, 2 * KV_GROWTH),
                                 (KV_GROWTH + 1, max_length, max_length)]:
        keys, values = cache.write(start, written[:, :, start:end], -written[:, :, start:end])
        assert cache.capacity == capacity
        # What was written before a growth is still there, and nothing past `end` is returned.
        assert torch.equal(keys, written[:, :, :end]) and torch.equal(values, -keys)
    with pytest.raises(ValueError, match=f"KV cache overflow: {max_length + 1} positions"):
        cache.write(max_length, written[:, :, :1], written[:, :, :1])


def test_the_sender_budget_must_hold_one_full_session(tiny_sharp_dir: Path) -> None:
    with pytest.raises(ConfigError, match="swarm.max_cached_tokens_per_sender .* must be at "
                                          "least swarm.max_session_tokens"):
        tiny_run_config(tiny_sharp_dir, 2, swarm={"max_session_tokens": 1024,
                                                  "max_cached_tokens_per_sender": 1023})


# ---- a stage-0 peer and two callers ---------------------------------------------------------

# Sessions of batch 2 and max_length 256: each one's cache holds 2 x 64 tokens after its first
# step, up to 2 x 256 = 512 (a whole session, the sender's whole budget).
BUDGET = {"max_session_tokens": 512, "max_cached_tokens_per_sender": 512,
          "max_sessions_per_sender": 2}
ROWS, MAX_LENGTH = 2, 256


class Caller:
    """A node that sends inference steps of token ids to one stage-0 peer."""

    def __init__(self, node: SwarmNode, peer: str) -> None:
        self.node, self.peer = node, peer

    @property
    def id(self) -> str:
        return self.node.peer_id

    def step(self, session: str, start: int, ids: torch.Tensor, rows: int = ROWS,
             max_length: int = MAX_LENGTH) -> tuple[int, torch.Tensor]:
        """Feed `ids` [rows, T] at positions [start, start + T): (positions held, hidden)."""
        new = ids.shape[1]
        tensors = {"inputs": ids, "positions": torch.arange(start, start + new).expand(rows, new),
                   "key_valid": torch.ones(rows, start + new, dtype=torch.bool)}
        reply, out = self.node.call_sync(
            self.peer, INFERENCE_STEP,
            InferenceStep(session=session, start=start, batch=rows, max_length=max_length),
            tensors, timeout=20)
        return reply.length, out["hidden"]

    def close(self, session: str) -> None:
        self.node.call_sync(self.peer, CLOSE_SESSION, CloseSession(session=session), timeout=20)


def tokens(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 30, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def callers(tiny_sharp_dir: Path) -> Iterator[tuple[Swarm, Caller, Caller]]:
    """A stage-0 peer under the small budget, its honest caller (the swarm's client, the run's
    owner) and a second caller the peer lets in as well: the session table must keep callers
    apart whoever the callers rule admits (net/authority.py admits the owner alone today)."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm=BUDGET)
    with start_swarm(config, [(0, "inference")]) as swarm:
        other = start_node(config, "other", swarm.client.addresses(), TensorLimits(),
                           LinkProfile())
        node = swarm.peer(0).node
        owner_only = node.authorize

        async def owner_or_other(sender: str, rpc: Rpc[Any, Any]) -> None:
            if sender != other.peer_id:
                await owner_only(sender, rpc)
        node.authorize = owner_or_other
        try:
            peer = node.peer_id
            yield swarm, Caller(swarm.client, peer), Caller(other, peer)
        finally:
            other.shutdown()


@pytest.mark.network
def test_another_caller_cannot_step_replay_over_or_close_a_session(
        callers: tuple[Swarm, Caller, Caller], tiny_sharp_dir: Path) -> None:
    swarm, honest, other = callers
    service = serving(swarm.peer(0))
    ids = tokens(ROWS, 6, seed=0)
    try:
        assert honest.step("shared", 0, ids[:, :3])[0] == 3
        # The other caller's step of the same id continues no session of its own: refused.
        with pytest.raises(PeerRefused, match="unknown session shared"):
            other.step("shared", 3, ids[:, 3:4])
        other.close("shared")  # closes nothing of the honest caller's
        # Its replay from position 0 opens its own session rather than rebuilding the honest one.
        assert other.step("shared", 0, tokens(ROWS, 4, seed=1))[0] == 4
        assert set(service.sessions) == {(honest.id, "shared"), (other.id, "shared")}
        assert service.sessions[honest.id, "shared"].cache.length == 3
        # The honest session carries on from its own cache, exactly as a local stage would.
        length, hidden = honest.step("shared", 3, ids[:, 3:])
        stage = build(load_model(str(tiny_sharp_dir)), 2)[0]
        with torch.inference_mode():
            expected = stage(ids, torch.arange(6).expand(ROWS, 6),
                             torch.ones(ROWS, 6, dtype=torch.bool))
        assert length == 6
        torch.testing.assert_close(hidden, expected[:, 3:], atol=1e-5, rtol=0)
        # Refusals of the other caller's steps were not its fault either: no strikes.
        assert swarm.peer(0).node.strikes(honest.id) == 0
    finally:
        honest.close("shared")
        other.close("shared")
    assert not service.sessions


@pytest.mark.network
def test_a_senders_budget_refuses_the_extra_session_and_tokens(
        callers: tuple[Swarm, Caller, Caller]) -> None:
    swarm, honest, other = callers
    service = serving(swarm.peer(0))
    opened = ["a", "b"]
    try:
        for session in opened:  # 2 x 64 tokens each
            honest.step(session, 0, tokens(ROWS, 3, seed=2))
        with pytest.raises(PeerRefused, match=r"holds 2 sessions here, the most "
                                              r"swarm.max_sessions_per_sender \(2\) allows"):
            honest.step("c", 0, tokens(ROWS, 3, seed=2))
        other.step("own", 0, tokens(ROWS, 3, seed=2))  # another sender has its own budget
        opened.append("own")
        # Session a grows to 2 x 192 tokens (with b's 128: 512, the budget), then past it.
        honest.step("a", 3, tokens(ROWS, KV_GROWTH, seed=3))
        honest.step("a", 3 + KV_GROWTH, tokens(ROWS, KV_GROWTH, seed=4))
        assert sum(s.cached_tokens for (owner, _), s in service.sessions.items()
                   if owner == honest.id) == 512
        # Past 3 chunks its cache grows to 2 x 256: with b's 128, 640.
        held, past = 3 + 2 * KV_GROWTH, tokens(ROWS, KV_GROWTH - 2, seed=5)
        with pytest.raises(PeerRefused, match=r"would hold 640 cached tokens \(batch x "
                                              r"positions\) here, over swarm.max_cached_tokens_"
                                              r"per_sender \(512\)"):
            honest.step("a", held, past)
        assert service.sessions[honest.id, "a"].cache.length == held  # refused, unchanged
        honest.close("b")
        assert honest.step("a", held, past)[0] == 3 * KV_GROWTH + 1
        # PeerBusy refusals: nothing counted against either sender.
        assert swarm.peer(0).node.strikes(honest.id) == 0
        assert swarm.peer(0).node.strikes(other.id) == 0
    finally:
        for session in opened:
            (other if session == "own" else honest).close(session)
    assert not service.sessions


@pytest.mark.network
def test_the_peers_kv_pool_refuses_a_session_past_it_whoever_sends_it(
        tiny_sharp_dir: Path) -> None:
    """The pool bounds every session on the peer together (a sender's budget only its own): at
    a pool of 4 sessions' first chunks, the fifth is refused (no strike) until one closes."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={
        "max_session_tokens": 512, "max_cached_tokens_per_sender": 1024,
        "kv_pool_tokens": 4 * ROWS * KV_GROWTH, "max_sessions_per_sender": 8})
    with start_swarm(config, [(0, "inference")]) as swarm:
        caller = Caller(swarm.client, swarm.peer(0).node.peer_id)
        for session in "abcd":
            caller.step(session, 0, tokens(ROWS, 3, seed=2))
        with pytest.raises(PeerRefused, match=r"the KV pool is full: its sessions would hold "
                                              r"640 cached tokens \(batch x positions\), over "
                                              r"swarm.kv_pool_tokens \(512\)"):
            caller.step("e", 0, tokens(ROWS, 3, seed=2))
        assert (caller.id, "e") not in serving(swarm.peer(0)).sessions
        assert swarm.peer(0).node.strikes(caller.id) == 0
        caller.close("a")
        assert caller.step("e", 0, tokens(ROWS, 3, seed=2))[0] == 3


def test_the_kv_pool_must_hold_one_full_session(tiny_sharp_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"swarm.kv_pool_tokens \(100\) must be at least "
                                          r"swarm.max_session_tokens"):
        tiny_run_config(tiny_sharp_dir, 2, swarm={"kv_pool_tokens": 100})


# ---- memory: sessions opened for many positions hold what they wrote ------------------------

def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.network
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_a_peer_holds_the_positions_written_not_max_length(tiny_sharp_dir: Path) -> None:
    """Three sessions of 512 rows opened for 512 positions, 3 written: a cache allocated for
    max_length would take 3 x 64 MiB; grown with use, each holds 64 positions (8 MiB)."""
    rows, max_length, sessions = 512, 512, 3
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"max_session_tokens": rows * max_length})
    with start_swarm(config, [(0, "inference")]) as swarm:
        caller = Caller(swarm.client, swarm.peer(0).node.peer_id)
        service = serving(swarm.peer(0))
        spec = swarm.peer(0).spec
        layers = len(service.model.layers)
        # Keys and values of one (row, position), fp32.
        per_token = layers * 2 * spec.num_kv_heads * spec.head_dim * 4
        caller.step("warm", 0, tokens(rows, 3, seed=0), rows, max_length)  # buffers, pools
        caller.close("warm")
        before = resident_bytes()
        for number in range(sessions):
            caller.step(f"m{number}", 0, tokens(rows, 3, seed=number), rows, max_length)
        grown = resident_bytes() - before
        held = sum(s.cache.nbytes for s in service.sessions.values())
        preallocated = sessions * rows * max_length * per_token
        assert held == sessions * rows * KV_GROWTH * per_token == preallocated // 8
        assert grown < preallocated // 2, (grown, preallocated)
        for number in range(sessions):
            caller.close(f"m{number}")
