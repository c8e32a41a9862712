"""Fuzzed requests through a live node: the checks after decoding. A stage peer (both roles, the
whole tiny model) serves every RPC it serves in a run; fuzzed bodies and tensors reach it on its
real streams, signed, for any of those RPCs. The coordinator's requests pass the callers rule
(net/authority.py), so each one goes through the RPC table's tensor declarations and the
handler's inbound checks (stage/inbound.py); a stranger's are refused before they are read.

Every request is served, or refused with a clear error: a strike where it is malformed (a
ValueError), none where it is well formed but cannot be served now (PeerBusy, ChunkUnavailable). Any other exception
raised while answering it (a bug: a TypeError, an IndexError) fails the test, and so does a
request that gets no answer within its timeout. Afterwards the peer still serves an honest
inference step.

The examples are few, each a network round trip (tests/fuzzing.py NETWORK_EXAMPLES_PER_TEST);
they count towards `make fuzz`'s floor like every other."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from fuzzing import NETWORK_EXAMPLES_PER_TEST, Outcomes, message_bytes, wire_values
from hypothesis import example, given, settings
from hypothesis import strategies as st
from swarm_helpers import Swarm, call_raw, envelope, start_node, start_swarm, tiny_run_config

from decentrl.launch.adversary import unchecked_encoding
from decentrl.net.guard import Guarded
from decentrl.net.link import LinkProfile
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_STEP,
    RPCS,
    CloseSession,
    Empty,
    InferenceStep,
    Rpc,
)
from decentrl.net.wire import TensorLimits, encode_struct
from decentrl.rollout.sampling import SamplingConfig
from decentrl.stage.inbound import PeerBusy
from decentrl.sync.chunks import ChunkUnavailable

NODE_FUZZ = settings(max_examples=NETWORK_EXAMPLES_PER_TEST, deadline=None)
# The RPCs a stage peer serves: all but the open ones (the coordinator's inbox, dial-backs).
SERVED = [rpc for rpc in RPCS.values() if rpc.callers != "any peer"]
# The refusals of well-formed requests a peer cannot serve in its present state: no strike.
NOT_NOW = (PeerBusy, ChunkUnavailable)
# Versions, positions, batch sizes a run has (and the edges of some).
SMALL_INTS = st.integers(-1, 9)
# Far from the tiny model's limits and its vocabulary, and at them.
SIZES = st.integers(0, 4) | st.sampled_from([8, 33, 513])
TENSORS = st.builds(
    lambda dtype, shape, fill: torch.full(shape, fill).to(dtype),
    st.sampled_from([torch.long, torch.bool, torch.float32, torch.bfloat16, torch.uint8]),
    st.lists(SIZES, max_size=3).map(tuple),
    st.sampled_from([0, 1, 3, 80, 81, -1, 2**40, 0.5, float("nan"), float("inf")]))


@dataclass
class Served:
    swarm: Swarm
    stranger: SwarmNode
    raised: list[BaseException]  # what answering the latest request raised, if anything

    @property
    def node(self) -> SwarmNode:
        return self.swarm.peers[0].node

    def __repr__(self) -> str:  # hypothesis prints it with a failing example
        return f"Served(peer {self.node.peer_id[-8:]})"


@pytest.fixture(scope="module")
def served(tiny_sharp_dir: Path) -> Iterator[Served]:
    config = tiny_run_config(tiny_sharp_dir, 1)
    with start_swarm(config, [(0, "both")]) as swarm:
        stranger = start_node(config, "stranger", swarm.client.addresses(), TensorLimits(),
                              LinkProfile())
        node = swarm.peers[0].node
        # Every strike counted and none aging out; no sender is ever blocked (a block would
        # refuse the next examples unread).
        node.strike_book.clock, node.strikes_to_block = (lambda: 0.0), 2**62
        raised: list[BaseException] = []
        answer = Guarded.answer

        async def observed_answer(guarded: Guarded[Any], *args: Any) -> Any:
            try:
                return await answer(guarded, *args)
            except BaseException as error:
                if guarded.guard is node.guard:  # the served peer's, not the client's
                    raised.append(error)
                raise

        Guarded.answer = observed_answer  # type: ignore[method-assign]
        try:
            yield Served(swarm, stranger, raised)
        finally:
            Guarded.answer = answer  # type: ignore[method-assign]
            stranger.shutdown()


@st.composite
def requests(draw: st.DrawFn) -> tuple[Rpc[Any, Any], bytes, dict[str, torch.Tensor]]:
    """An RPC, a body for it (well formed or not), and tensors named as it declares or not."""
    rpc = draw(st.sampled_from(SERVED))
    plausible = wire_values(msgspec.inspect.type_info(rpc.request), SMALL_INTS)
    body = draw(message_bytes(rpc.request) | plausible.map(msgspec.msgpack.encode), label="body")
    names = st.sampled_from([*rpc.tensors, "extra"])
    tensors = draw(st.dictionaries(names, TENSORS, max_size=len(rpc.tensors) + 1)
                   | st.fixed_dictionaries(dict.fromkeys(rpc.tensors, TENSORS)), label="tensors")
    return rpc, body, tensors


@NODE_FUZZ
@given(request=requests(), from_stranger=st.booleans())
@example(request=(RPCS["train_grad_norm"], encode_struct(Empty()), {}), from_stranger=False)
@example(request=(CLOSE_SESSION, encode_struct(CloseSession(session="none")), {}),
         from_stranger=True)
# Far over the request limit: the peer reads no further and cuts the stream, and the reset can
# overtake its refusal; either way a refusal and one strike.
@example(request=(RPCS["verify_step"], encode_struct(Empty()),
                  {"inputs": torch.full((33, 513, 513), float("inf"))}), from_stranger=False)
def send_fuzzed_request(served: Served, outcomes: Outcomes,
                        request: tuple[Rpc[Any, Any], bytes, dict[str, torch.Tensor]],
                        from_stranger: bool) -> None:
    rpc, body, tensors = request
    sender = served.stranger if from_stranger else served.swarm.client
    node = served.node
    strikes = node.strikes(sender.peer_id)
    served.raised.clear()
    parts, manifest = unchecked_encoding(tensors)
    try:
        call_raw(sender, node.peer_id, rpc.method, envelope(body, manifest), parts, timeout=30)
    except RemoteError as refusal:
        assert str(refusal)
        if from_stranger:  # refused unread by the callers rule (a strike where it is one)
            assert not served.raised
            assert "is for the" in str(refusal), refusal
        elif node.strikes(sender.peer_id) != strikes + 1:  # not a malformed request: busy
            assert len(served.raised) == 1, (rpc.method, refusal, served.raised)
            assert isinstance(served.raised[0], NOT_NOW), (rpc.method, served.raised[0])
        outcomes.refuse()
        return
    assert not from_stranger and node.strikes(sender.peer_id) == strikes
    outcomes.accept()


@pytest.mark.network
def test_fuzzed_requests_through_a_node_are_served_or_refused_clearly(
        served: Served, fuzz_outcomes: Outcomes) -> None:
    send_fuzzed_request(served, fuzz_outcomes)
    fuzz_outcomes.assert_both_branches_ran()
    # The peer still serves an honest step.
    swarm = served.swarm
    tensors = {"inputs": torch.tensor([[1, 2, 3]]), "positions": torch.arange(3)[None],
               "key_valid": torch.ones(1, 3, dtype=torch.bool)}
    step = InferenceStep(session="honest", start=0, batch=1, max_length=8,
                         sampling=SamplingConfig(temperature=0.0))
    _, out = swarm.client.call_sync(served.node.peer_id, INFERENCE_STEP, step, tensors)
    assert out["tokens"].shape == (1,)
