"""Bounded resources on the wire (net/streams.py, net/serving.py, the limits in net/protocol.py):
a message header that declares more than its RPC's limit is refused before any of the message is
read, every RPC has limits of its own that admit its largest honest messages, replies are read
with a cap, a stream that sends nothing is cut, one sender's concurrent streams are capped, and
the caller policy runs before any of a request is read, all senders together hold at most the
node's budget of request bytes, and the coordinator serves no rollout inbox to other peers. The
network tests attack a live stage peer (a tiny model) from a stranger's node."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from swarm_helpers import serving, start_peer, tiny_run_config

from decentrl.learn.batch import BATCH_FIELDS
from decentrl.net.authority import CallerRefused
from decentrl.net.identity import Identity
from decentrl.net.inflight_budget import InflightBudget, NodeBusy
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, RemoteError, Reply, Request, SwarmNode
from decentrl.net.protocol import (
    CLOSE_SESSION,
    INFERENCE_PUSH,
    INFERENCE_RESUME,
    INFERENCE_STEP,
    MAX_SYNC_PLAN_BYTES,
    SUBMIT_ROLLOUTS,
    SYNC_CHUNK,
    SYNC_PLAN,
    TRAIN_BACKWARD,
    TRAIN_FORWARD,
    VERIFY_STEP,
    ChunkRequest,
    CloseSession,
    Empty,
    InferenceStep,
    PeerRecord,
    Rpc,
    SyncPlanRequest,
    stage_key,
)
from decentrl.net.push_messages import PushAck
from decentrl.net.serving import MAX_STREAMS_PER_SENDER, READ_TIMEOUT_S
from decentrl.net.signing import signed_envelope
from decentrl.net.sizes import RunSizes, size_limit
from decentrl.net.streams import (
    FRAME_HEADER_BYTES,
    ErrorFrame,
    FrameReader,
    FrameRefused,
    StreamStalled,
)
from decentrl.net.swarm_transport import HivemindTransport
from decentrl.net.text import REMOTE_ERROR_CHARS
from decentrl.net.wire import (
    MAX_MESSAGE_BYTES,
    TensorLimits,
    WireError,
    encode_struct,
    encode_tensors,
    to_messages,
)
from decentrl.rollout.types import RolloutGroup
from decentrl.stage.peer import StagePeer
from decentrl.sync.distribute import MAX_CHUNK_BYTES

HUGE = 2**34  # a declared length no reader should believe


def frame(payload: bytes, error: bool = False) -> bytes:
    marker = P2P.ERROR_MARKER if error else P2P.MESSAGE_MARKER
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


def header(length: int) -> bytes:
    """A message frame's header alone, declaring `length` bytes."""
    return P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


def fed(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


END = frame(b"", error=True)
MESSAGE = frame(runtime_pb2.ExpertRequest(uid="u").SerializeToString())


# ---- the framed reader ---------------------------------------------------------------------------

def test_a_frame_over_the_limit_is_refused_from_its_header_alone() -> None:
    async def scenario() -> None:
        junk = os.urandom(1024)
        reader = fed(header(HUGE) + junk)
        with pytest.raises(FrameRefused, match=rf"x request over 1000 bytes: a message of {HUGE} "
                                               r"bytes after 0"):
            await FrameReader(reader, "x request", 1000, None).next()
        assert await reader.read() == junk  # none of the message was read
        # Within the stream's limit, but over the cap on one message.
        big = FrameReader(fed(header(MAX_MESSAGE_BYTES + 1)), "x request", 10**9, None)
        with pytest.raises(FrameRefused, match=rf"a message of {MAX_MESSAGE_BYTES + 1} bytes is "
                                               rf"over the {MAX_MESSAGE_BYTES}-byte message cap"):
            await big.next()
        # The limit counts every frame's header and payload, whatever the frames.
        many = FrameReader(fed(MESSAGE * 20 + END), "x request", 10 * len(MESSAGE), None)
        with pytest.raises(FrameRefused, match=rf"over {10 * len(MESSAGE)} bytes"):
            await many.requests(runtime_pb2.ExpertRequest)
        with pytest.raises(FrameRefused, match=r"x request: b'\\x07' is no frame marker"):
            await FrameReader(fed(b"\x07" + bytes(8)), "x request", 1000, None).next()
        with pytest.raises(FrameRefused, match="does not decode as ExpertRequest"):
            await FrameReader(fed(frame(b"\xff\xff") + END), "x request", 1000,
                              None).requests(runtime_pb2.ExpertRequest)
    asyncio.run(scenario())


def test_requests_end_at_their_end_frame_and_a_cut_stream_has_none() -> None:
    async def scenario() -> None:
        stream = FrameReader(fed(MESSAGE * 2 + END), "x request", 1000, None)
        assert [m.uid for m in await stream.requests(runtime_pb2.ExpertRequest) or []] == ["u"] * 2
        assert stream.ended
        cut = FrameReader(fed(MESSAGE + MESSAGE[:5]), "x request", 1000, None)
        assert await cut.requests(runtime_pb2.ExpertRequest) is None  # the caller went away
        # Replies run until the peer closes; a reply cut short comes back short.
        short = FrameReader(fed(MESSAGE + MESSAGE[:5]), "x reply", 1000, None)
        assert len(await short.replies(runtime_pb2.ExpertRequest)) == 1
    asyncio.run(scenario())


def test_a_peer_refusal_raises_its_text_cut_short() -> None:
    async def scenario() -> None:
        text = "no " * 1000  # 3000 characters
        reader = fed(MESSAGE + frame(RPCError(message=text).SerializeToString(), error=True))
        with pytest.raises(ErrorFrame) as refused:
            await FrameReader(reader, "x reply", 10**6, None).replies(runtime_pb2.ExpertRequest)
        assert str(refused.value) == f"{text[:REMOTE_ERROR_CHARS]}…(+2500 chars)"
    asyncio.run(scenario())


def test_a_stream_that_sends_nothing_stalls() -> None:
    async def scenario() -> None:
        reader = fed(header(100) + b"abc", eof=False)
        with pytest.raises(StreamStalled, match=r"x request: nothing came for 0.05s"):
            await FrameReader(reader, "x request", 1000, 0.05).next()
    asyncio.run(scenario())


def test_a_message_past_the_nodes_budget_is_refused_as_busy_before_it_is_read() -> None:
    async def scenario() -> None:
        budget = InflightBudget(1000)
        first = FrameReader(fed(frame(bytes(600)) + END), "x request", 10_000, None, budget)
        assert await first.next() is not None and budget.held == 600
        after = b"not part of the request"
        second = fed(frame(bytes(500)) + END + after)
        stream = FrameReader(second, "y request", 10_000, None, budget)
        with pytest.raises(NodeBusy, match=r"y request: this node is busy, it holds 600 bytes "
                                           r"of requests in flight and 500 more would pass its "
                                           r"budget of 1000; try again later"):
            await stream.next()
        assert budget.held == 600 and budget.refused == 1  # nothing of it was taken or read
        await stream.discard_rest(budget=1000)  # read past and dropped, never held
        assert await second.read() == after
        first.release()
        stream.release()
        assert budget.held == 0
    asyncio.run(scenario())


def test_a_refused_request_is_read_to_its_end_within_a_budget() -> None:
    """So that the refusal reaches an honest caller before the stream closes; never more than
    the budget, and not past the end of the request."""
    async def scenario() -> None:
        after = b"not part of the request"
        oversized = frame(bytes(300))
        reader = fed(oversized + MESSAGE + END + after)
        stream = FrameReader(reader, "x request", 100, None)
        with pytest.raises(FrameRefused):
            await stream.next()
        await stream.discard_rest(budget=1000)
        assert stream.ended and await reader.read() == after
        # Over the budget: left unread.
        reader = fed(oversized + END)
        stream = FrameReader(reader, "x request", 100, None)
        with pytest.raises(FrameRefused):
            await stream.next()
        await stream.discard_rest(budget=200)
        assert await reader.read() == bytes(300) + END
    asyncio.run(scenario())


# ---- each RPC's limits admit its largest honest messages ------------------------------------

SIZES = RunSizes(hidden_size=32, max_positions=64, max_session_tokens=128, micro_batch_size=3)


def wire_bytes(kind: str, rpc: Rpc[Any, Any], tensors: dict[str, torch.Tensor]) -> int:
    """The bytes on the wire of a message carrying `tensors` at the widest codec (fp32), its
    frame headers and the end-of-requests frame included."""
    parts, manifest = encode_tensors(tensors, "fp32")
    metadata = signed_envelope(Identity.generate(), "request" if kind == "request" else "reply",
                               rpc.method, "0123456789abcdef", encode_struct(Empty()), manifest,
                               parts)
    message_type = runtime_pb2.ExpertRequest if kind == "request" else runtime_pb2.ExpertResponse
    messages = to_messages(message_type, metadata, parts)  # type: ignore[type-var]
    return sum(FRAME_HEADER_BYTES + m.ByteSize() for m in messages) + FRAME_HEADER_BYTES


def zeros(kind: str, *shape: int) -> torch.Tensor:
    dtype = {"int64": torch.long, "bool": torch.bool, "float32": torch.float32}[kind]
    return torch.zeros(shape, dtype=dtype)


def largest_step(targets: bool) -> dict[str, torch.Tensor]:
    """A whole session of hidden states in one step: batch x max_length = max_session_tokens."""
    batch, length, hidden = 2, SIZES.max_session_tokens // 2, SIZES.hidden_size
    tensors = {"inputs": torch.randn(batch, length, hidden),
               "positions": zeros("int64", batch, length), "key_valid": zeros("bool", batch, length)}
    return tensors | ({"targets": zeros("int64", batch, length)} if targets else {})


def largest_step_reply() -> dict[str, torch.Tensor]:
    """Hidden states of every position."""
    return {"hidden": torch.randn(2, SIZES.max_session_tokens // 2, SIZES.hidden_size)}


def largest_micro_batch() -> dict[str, torch.Tensor]:
    """micro_batch_size rows, prompts and completions max_positions long, hidden-state inputs,
    both optional log-probs."""
    rows, length, hidden = SIZES.micro_batch_size, SIZES.max_positions, SIZES.hidden_size
    tokens = torch.Size([rows, length])
    tensors = {name: torch.zeros(rule.shape(tokens, tokens), dtype=rule.dtype)
               for name, rule in BATCH_FIELDS.items()}
    return tensors | {"prompt_in": torch.randn(rows, length, hidden),
                      "completion_in": torch.randn(rows, length, hidden),
                      "proximal": zeros("float32", rows, length),
                      "reference": zeros("float32", rows, length)}


def activation_pair(first: str, second: str) -> dict[str, torch.Tensor]:
    shape = (SIZES.micro_batch_size, SIZES.max_positions, SIZES.hidden_size)
    return {first: torch.randn(shape), second: torch.randn(shape)}


@pytest.mark.parametrize(("rpc", "kind", "tensors"), [
    (INFERENCE_STEP, "request", largest_step(targets=False)),
    (VERIFY_STEP, "request", largest_step(targets=True)),
    (INFERENCE_STEP, "reply", largest_step_reply()),
    (TRAIN_FORWARD, "request", largest_micro_batch()),
    (TRAIN_FORWARD, "reply", activation_pair("prompt_out", "completion_out")
     | {"row_surprise": zeros("float32", 3), "row_log_ratio": zeros("float32", 3)}),
    (TRAIN_BACKWARD, "request", activation_pair("prompt_grad", "completion_grad")),
    (TRAIN_BACKWARD, "reply", activation_pair("prompt_grad", "completion_grad")),
    (SYNC_CHUNK, "reply", {"data": torch.zeros(MAX_CHUNK_BYTES, dtype=torch.uint8)}),
], ids=lambda value: value.method if isinstance(value, Rpc) else None)
def test_each_rpc_limit_admits_its_largest_honest_message(rpc: Rpc[Any, Any], kind: str,
                                                           tensors: dict[str, torch.Tensor]
                                                           ) -> None:
    limit = size_limit(rpc.max_bytes if kind == "request" else rpc.max_reply_bytes, SIZES)
    assert limit is not None
    honest = wire_bytes(kind, rpc, tensors)
    # Room for the honest message, and not much more: its own limit, not the node's 1 GiB.
    assert honest <= limit < 2 * honest + 2**17, (honest, limit)


# A mixture of experts: 3 sparse layers, top 2, at the widest index dtype (int16).
ROUTED = RunSizes(hidden_size=32, max_positions=64, max_session_tokens=128, micro_batch_size=3,
                  routing_bytes=3 * 2 * 2)


def experts(*leading: int) -> torch.Tensor:
    return torch.zeros((*leading, 3, 2), dtype=torch.int16)


@pytest.mark.parametrize(("rpc", "kind", "tensors"), [
    (INFERENCE_STEP, "reply", largest_step_reply() | {"experts": experts(2, 64)}),
    (INFERENCE_STEP, "reply", {"tokens": zeros("int64", 2), "logprobs": zeros("float32", 2),
                               "experts": experts(2, 64)}),
    (TRAIN_FORWARD, "request", largest_micro_batch() | {"routing": experts(3, 64)}),
], ids=lambda value: value.method if isinstance(value, Rpc) else None)
def test_a_mixture_of_experts_limits_admit_its_routing(rpc: Rpc[Any, Any], kind: str,
                                                      tensors: dict[str, torch.Tensor]) -> None:
    """Every position's experts beside a step's largest reply (hidden states, or the last
    stage's samples), every completion token's beside the largest micro-batch: within the
    limits of a run whose sizes count them, and not far under."""
    limit = size_limit(rpc.max_bytes if kind == "request" else rpc.max_reply_bytes, ROUTED)
    assert limit is not None
    honest = wire_bytes(kind, rpc, tensors)
    assert honest <= limit < 2 * honest + 2**17, (honest, limit)


@pytest.mark.parametrize("rpc", [INFERENCE_PUSH, INFERENCE_RESUME], ids=lambda rpc: rpc.method)
def test_a_push_ack_fits_its_small_limit_with_the_longest_detail(rpc: Rpc[Any, Any]) -> None:
    """A failure's detail is cut to 500 characters (stage/push.py); at 4 bytes a character it
    still fits, and the limit leaves most of a relayed connection to the requests."""
    ack = PushAck(failed_stage=7, detail="\U0001f4a5" * 500, missing=True)
    metadata = signed_envelope(Identity.generate(), "reply", rpc.method, "0123456789abcdef",
                               encode_struct(ack), [], [])
    messages = to_messages(runtime_pb2.ExpertResponse, metadata, [])
    honest = sum(FRAME_HEADER_BYTES + m.ByteSize() for m in messages) + FRAME_HEADER_BYTES
    limit = size_limit(rpc.max_reply_bytes, None)
    assert limit is not None and honest <= limit <= 8 * 2**10, (honest, limit)


def test_a_limit_that_depends_on_the_run_needs_its_sizes() -> None:
    assert size_limit(INFERENCE_STEP.max_bytes, None) is None
    assert size_limit(CLOSE_SESSION.max_bytes, None) == size_limit(CLOSE_SESSION.max_bytes, SIZES)


def test_node_refuses_nonsense_stream_settings() -> None:
    with pytest.raises(ValueError, match="read_timeout_s > 0"):
        SwarmNode("x", LinkProfile(), TensorLimits(), read_timeout_s=0)
    with pytest.raises(ValueError, match="max_streams_per_sender >= 1"):
        SwarmNode("x", LinkProfile(), TensorLimits(), max_streams_per_sender=0)


# ---- a live stage peer, attacked from a stranger's node -------------------------------------

@pytest.fixture(scope="module")
def served(tiny_sharp_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[StagePeer, SwarmNode]]:
    """Stage 0 of a tiny two-stage model (inference and training), sessions of at most 64
    tokens; and the attacker's node. The attacker is the run's owner here, so that the callers
    rule (tests/swarm/test_authority.py) lets it through and what is tested is the bounds every
    request meets, whoever sends it."""
    config = tiny_run_config(tiny_sharp_dir, 2, swarm={"max_session_tokens": 64})
    stranger = SwarmNode.start("stranger", [], LinkProfile(), TensorLimits())
    try:
        peer = start_peer(config, 0, "both", stranger.addresses(), stranger.peer_id,
                          checkpoint_dir=tmp_path_factory.mktemp("ckpt"), name="s0")
        try:
            yield peer, stranger
        finally:
            peer.stop()
            peer.node.shutdown()
    finally:
        stranger.shutdown()


@pytest.fixture
def peer(served: tuple[StagePeer, SwarmNode]) -> Iterator[StagePeer]:
    """The stage peer, its node's settings back to their defaults after the test."""
    stage_peer = served[0]
    yield stage_peer
    node = stage_peer.node
    node.server.read_timeout_s = READ_TIMEOUT_S
    node.server.max_streams_per_sender = MAX_STREAMS_PER_SENDER
    node.authorize, node.on_strike = stage_peer.authority.check, None
    node.server.inflight = InflightBudget()


@pytest.fixture
def stranger(served: tuple[StagePeer, SwarmNode]) -> SwarmNode:
    return served[1]


def strike_reasons(node: SwarmNode) -> list[str]:
    reasons: list[str] = []
    node.on_strike = lambda peer, reason: reasons.append(reason)
    return reasons


def honest_step(stranger: SwarmNode, peer: StagePeer) -> None:
    """A correct inference step, and the session closed again."""
    session = secrets.token_hex(4)
    tensors = {"inputs": torch.tensor([[1, 2, 3]]), "positions": torch.arange(3)[None],
               "key_valid": torch.ones(1, 3, dtype=torch.bool)}
    _, out = stranger.call_sync(peer.node.peer_id, INFERENCE_STEP,
                                InferenceStep(session=session, start=0, batch=1, max_length=8),
                                tensors, timeout=30)
    assert out["hidden"].shape == (1, 3, peer.spec.hidden_size)
    stranger.call_sync(peer.node.peer_id, CLOSE_SESSION, CloseSession(session=session))


async def open_stream(node: SwarmNode, peer: str, method: str
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw stream to `peer`'s RPC `method`: what a hostile caller writes into it is its
    choice."""
    return await open_stream_to(node, peer, f"decentrl.{method}")


async def open_stream_to(node: SwarmNode, peer: str, protocol: str
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    assert node.p2p is not None
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                  protocol)
    return reader, writer


async def stalled(node: SwarmNode, peer: str, method: str
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw stream that sends a message header, and nothing more."""
    reader, writer = await open_stream(node, peer, method)
    writer.write(header(100))
    await writer.drain()
    return reader, writer


async def answer_of(reader: asyncio.StreamReader) -> bytes:
    """Everything the peer sends until it closes the stream (nothing if it reset it)."""
    try:
        async with asyncio.timeout(60):  # a deadlock guard, not a measurement
            return await reader.read()
    except ConnectionError:
        return b""


def error_text(answer: bytes) -> str:
    assert answer[:1] == P2P.ERROR_MARKER, answer[:64]
    return RPCError.FromString(answer[FRAME_HEADER_BYTES:]).message


async def next_error(reader: asyncio.StreamReader) -> str:
    """The text of the error frame the peer sends next (the stream stays open)."""
    async with asyncio.timeout(60):  # a deadlock guard, not a measurement
        head = await reader.readexactly(FRAME_HEADER_BYTES)
        length = int.from_bytes(head[1:], P2P.BYTEORDER)
        return error_text(head + await reader.readexactly(length))


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()


def resident_bytes(pid: int | str = "self") -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30  # a deadlock guard, not a measurement
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


# What the stranger sends after its 16 GiB header: a reader that believed the header would hold
# all of it in memory.
SENT_AFTER_HEADER = 64 * 2**20


@pytest.mark.network
def test_a_declared_length_over_the_limit_is_refused_unread(peer: StagePeer,
                                                            stranger: SwarmNode) -> None:
    reasons = strike_reasons(peer.node)
    piece = os.urandom(2**16)

    async def attack() -> bytes:
        reader, writer = await open_stream(stranger, peer.node.peer_id, "inference_step")
        with contextlib.closing(writer):
            writer.write(header(HUGE))
            with contextlib.suppress(ConnectionError):  # the peer cuts the stream
                for _ in range(SENT_AFTER_HEADER // len(piece)):
                    writer.write(piece)
                    await writer.drain()
            return await answer_of(reader)

    before = resident_bytes()
    answer = stranger.run(attack(), timeout=120)
    assert resident_bytes() - before < SENT_AFTER_HEADER // 4
    limit = size_limit(INFERENCE_STEP.max_bytes, peer.node.sizes)
    refusal = f"inference_step request over {limit} bytes: a message of {HUGE} bytes after 0"
    assert reasons == [f"inference_step: {refusal}"]
    assert not answer or error_text(answer) == refusal  # the refusal, unless the cut overtook it
    assert peer.node.open_streams(stranger.peer_id) == 0
    honest_step(stranger, peer)  # and it keeps serving


@pytest.mark.network
def test_a_dht_request_over_the_daemons_cap_is_refused_unread(peer: StagePeer,
                                                              stranger: SwarmNode) -> None:
    """Hivemind's DHT RPCs are unary calls: the p2p daemon reads each with a length-delimited
    reader capped at 4 MiB before Python sees it (net/streams.py), so the same 16 GiB header
    grows neither the daemon nor this process."""
    assert peer.node.p2p is not None and peer.node.p2p._child is not None
    daemon = peer.node.p2p._child.pid
    piece = os.urandom(2**16)

    async def attack() -> bytes:
        reader, writer = await open_stream_to(stranger, peer.node.peer_id, "DHTProtocol.rpc_store")
        with contextlib.closing(writer):
            writer.write(varint(HUGE))
            with contextlib.suppress(ConnectionError):
                for _ in range(SENT_AFTER_HEADER // len(piece)):
                    writer.write(piece)
                    await writer.drain()
            return await answer_of(reader)

    before, daemon_before = resident_bytes(), resident_bytes(daemon)
    assert stranger.run(attack(), timeout=120) == b""
    assert resident_bytes() - before < SENT_AFTER_HEADER // 4
    assert resident_bytes(daemon) - daemon_before < SENT_AFTER_HEADER // 4
    # The DHT still answers the stranger, and the peer its RPCs.
    assert stranger.dht is not None
    assert stranger.run(stranger.dht.protocol.call_ping(PeerID.from_base58(peer.node.peer_id)),
                        timeout=30) is not None
    honest_step(stranger, peer)


@pytest.mark.network
def test_a_request_over_its_rpcs_own_limit_is_refused(peer: StagePeer,
                                                      stranger: SwarmNode) -> None:
    reasons = strike_reasons(peer.node)
    limit = size_limit(INFERENCE_STEP.max_bytes, peer.node.sizes)
    assert limit is not None and limit < TensorLimits().max_total_bytes // 1000
    positions = limit // (4 * peer.spec.hidden_size) + 1  # hidden states of more than the limit
    tensors = {"inputs": torch.randn(1, positions, peer.spec.hidden_size),
               "positions": torch.zeros(1, positions, dtype=torch.long),
               "key_valid": torch.ones(1, positions, dtype=torch.bool)}
    body = InferenceStep(session="big", start=0, batch=1, max_length=positions)
    with pytest.raises(PeerRefused, match=rf"inference_step request over {limit} bytes"):
        stranger.call_sync(peer.node.peer_id, INFERENCE_STEP, body, tensors, timeout=30)
    assert len(reasons) == 1 and f"over {limit} bytes" in reasons[0]
    assert not serving(peer).sessions
    honest_step(stranger, peer)


@pytest.mark.network
def test_a_stalled_or_idle_stream_is_cut_after_the_read_timeout(peer: StagePeer,
                                                                stranger: SwarmNode) -> None:
    reasons = strike_reasons(peer.node)
    peer.node.server.read_timeout_s = 1.0

    async def stall(opening: bytes) -> bytes:
        reader, writer = await open_stream(stranger, peer.node.peer_id, "inference_step")
        with contextlib.closing(writer):
            writer.write(opening)
            await writer.drain()
            return await answer_of(reader)

    # A stream that sends nothing at all, and one that stops inside a message.
    for opening in (b"", header(100) + b"0123456789"):
        answer = stranger.run(stall(opening), timeout=90)
        assert error_text(answer) == "inference_step request: nothing came for 1s"
    assert reasons == []  # a stall is no strike: an honest peer's link can break
    assert peer.node.open_streams(stranger.peer_id) == 0
    honest_step(stranger, peer)


@pytest.mark.network
def test_concurrent_streams_over_the_cap_are_refused(peer: StagePeer,
                                                     stranger: SwarmNode) -> None:
    node = peer.node
    reasons = strike_reasons(node)
    node.server.max_streams_per_sender, node.server.read_timeout_s = 2, 60.0
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def hold() -> None:
        """A stream that sends a header and stalls (held open for read_timeout_s)."""
        held.append(stranger.run(stalled(stranger, node.peer_id, "inference_step"), timeout=30))
        wait_until(lambda: node.open_streams(stranger.peer_id) == len(held))

    try:
        hold()
        hold()
        with pytest.raises(PeerRefused, match=r"inference_step: peer \w{8} has 2 requests open "
                                              r"here already"):
            honest_step(stranger, peer)
        assert reasons == []  # no strike: a busy honest caller gets there
        # Refused streams count until they are closed; past twice the cap the sender floods:
        # a strike, and the stream is cut unanswered.
        hold()
        hold()
        assert "has 2 requests open here already" in stranger.run(next_error(held[2][0]), 90)

        async def fifth() -> bytes:
            reader, writer = await open_stream(stranger, node.peer_id, "close_session")
            with contextlib.closing(writer):
                writer.write(header(100))
                with contextlib.suppress(ConnectionError):  # the peer may cut it first
                    await writer.drain()
                return await answer_of(reader)
        assert stranger.run(fifth(), timeout=90) == b""
        assert reasons == ["close_session: 5 requests open at once; the stream is cut unanswered"]
    finally:
        for _, held_writer in held:
            stranger.run(close(held_writer), timeout=30)
    wait_until(lambda: node.open_streams(stranger.peer_id) == 0)
    honest_step(stranger, peer)


@pytest.mark.network
def test_streams_count_right_whichever_closes_first(peer: StagePeer, stranger: SwarmNode,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    node = peer.node
    node.server.read_timeout_s = 60.0
    streams = [stranger.run(stalled(stranger, node.peer_id, "inference_step"), timeout=30)]
    wait_until(lambda: node.open_streams(stranger.peer_id) == 1)
    streams.append(stranger.run(stalled(stranger, node.peer_id, "inference_step"), timeout=30))
    wait_until(lambda: node.open_streams(stranger.peer_id) == 2)
    # The first one opened closes first: the other still counts, and then nothing does.
    stranger.run(close(streams[0][1]), timeout=30)
    wait_until(lambda: node.open_streams(stranger.peer_id) == 1)
    stranger.run(close(streams[1][1]), timeout=30)
    wait_until(lambda: node.open_streams(stranger.peer_id) == 0)
    assert "Unhandled exception" not in caplog.text
    honest_step(stranger, peer)


async def serving_nothing(request: Request[Any]) -> Reply:
    raise AssertionError("never served")


@pytest.mark.network
def test_a_reply_over_its_rpcs_limit_is_refused_by_the_caller(stranger: SwarmNode) -> None:
    liar = SwarmNode.start("liar", stranger.addresses(), LinkProfile(), TensorLimits())
    try:
        with pytest.raises(ValueError, match="inference_step's request limit depends on the "
                                             "run's sizes"):
            liar.serve(INFERENCE_STEP, serving_nothing)

        async def everyone(sender: str, rpc: Rpc[Any, Any]) -> None:
            pass  # the liar serves the caller's weight-sync requests whoever it is
        liar.authorize = everyone

        async def oversized_chunk(request: Request[ChunkRequest]) -> Reply:
            return Reply(Empty(), {"data": torch.zeros(3 * 2**20, dtype=torch.uint8)})
        liar.serve(SYNC_CHUNK, oversized_chunk)

        async def huge_header(info: StreamInfo, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
            with contextlib.closing(writer):
                writer.write(header(HUGE) + bytes(2**16))
                await writer.drain()
                await answer_of(reader)  # until the caller gives up
        assert liar.p2p is not None
        liar.run(liar.p2p.add_binary_stream_handler("decentrl.sync_plan", huge_header), 30)

        chunk_limit = size_limit(SYNC_CHUNK.max_reply_bytes, None)
        request = ChunkRequest(stage=0, kind="delta", version=1, index=0, wait_s=0.0)
        with pytest.raises(WireError, match=rf"sync_chunk reply over {chunk_limit} bytes"):
            stranger.call_sync(liar.peer_id, SYNC_CHUNK, request, timeout=30)
        with pytest.raises(WireError, match=rf"sync_plan reply over {MAX_SYNC_PLAN_BYTES} bytes: "
                                            rf"a message of {HUGE} bytes"):
            stranger.call_sync(liar.peer_id, SYNC_PLAN,
                               SyncPlanRequest(stage=0, version=0, state_hash=""), timeout=30)
    finally:
        liar.shutdown()


@pytest.mark.network
def test_a_caller_policy_refuses_before_the_request_is_read(peer: StagePeer,
                                                            stranger: SwarmNode) -> None:
    reasons = strike_reasons(peer.node)
    asked: list[tuple[str, str]] = []

    async def coordinator_only(sender: str, rpc: Rpc[Any, Any]) -> None:
        asked.append((sender, rpc.method))
        raise CallerRefused(f"{rpc.method}: peer {sender[-8:]} may not call it (rule: the "
                            f"run's coordinator only)")
    peer.node.authorize = coordinator_only
    rule = rf"inference_step: peer {stranger.peer_id[-8:]} may not call it \(rule: the run's " \
           r"coordinator only\)"
    with pytest.raises(PeerRefused, match=rule):
        honest_step(stranger, peer)
    assert asked == [(stranger.peer_id, "inference_step")]
    assert not serving(peer).sessions  # the handler never ran
    assert len(reasons) == 1 and "may not call it" in reasons[0]  # a strike

    # Refused before any of the request is read: a 16 GiB header is not even looked at.
    async def huge() -> bytes:
        reader, writer = await open_stream(stranger, peer.node.peer_id, "inference_step")
        with contextlib.closing(writer):
            writer.write(header(HUGE))
            with contextlib.suppress(ConnectionError):  # the peer may cut it first
                await writer.drain()
            return await answer_of(reader)
    answer = stranger.run(huge(), timeout=90)
    assert not answer or "may not call it" in error_text(answer)
    assert len(reasons) == 2 and "may not call it" in reasons[1]

    peer.node.authorize = peer.authority.check
    honest_step(stranger, peer)


@pytest.mark.network
def test_requests_in_flight_from_all_senders_share_one_budget(peer: StagePeer,
                                                              stranger: SwarmNode) -> None:
    """A volunteer (announced in the stage, not the coordinator) holds part of the budget with
    a request it never finishes; the coordinator's request that does not fit in the rest is
    refused as busy, unread and without a strike, and served once the volunteer lets go."""
    node = peer.node
    reasons = strike_reasons(node)
    node.server.read_timeout_s = 60.0
    node.server.inflight = InflightBudget(300)
    volunteer = SwarmNode.start("volunteer", stranger.addresses(), LinkProfile(), TensorLimits())
    try:
        record = PeerRecord(name="volunteer", stage=0, layers=(0, 1), role="inference",
                            version=0, tokens_per_s=0.0, free_sessions=1, training_ready=False)
        volunteer.run(volunteer.announce(stage_key(peer.config.name, 0), encode_struct(record),
                                         10), timeout=30)
        _, held = volunteer.run(stalled(volunteer, node.peer_id, "sync_plan"), timeout=30)
        wait_until(lambda: node.server.inflight.held == 100)
        with pytest.raises(PeerRefused, match=r"inference_step request: this node is busy"):
            honest_step(stranger, peer)
        assert reasons == [] and node.server.inflight.held == 100
        volunteer.run(close(held), timeout=30)
        wait_until(lambda: node.server.inflight.held == 0)
        node.server.inflight = InflightBudget()
        honest_step(stranger, peer)
    finally:
        volunteer.shutdown()


@pytest.mark.network
def test_the_coordinators_inbox_refuses_a_strangers_submission_before_any_of_it_is_read(
        ) -> None:
    coordinator = SwarmNode.start("coordinator", [], LinkProfile(), TensorLimits())
    stranger = SwarmNode.start("stranger", coordinator.addresses(), LinkProfile(),
                               TensorLimits())
    transport = HivemindTransport(coordinator, coordinator.peer_id, inbox_size=4)
    try:
        flood = replace(SUBMIT_ROLLOUTS, request=Empty)
        tensors = {"inputs": torch.zeros(2 * 2**20)}  # 8 MiB, under the submission limit
        with pytest.raises(RemoteError, match="protocols not supported: "
                                              r"\[decentrl.submit_rollouts\]"):
            stranger.call_sync(coordinator.peer_id, flood, Empty(), tensors, timeout=30)
        assert coordinator.server.inflight.held == 0 and coordinator.strikes(stranger.peer_id) == 0
        # The coordinator's own generation loops still queue and take their groups.
        group = RolloutGroup(group_id="g", task="sums", problem_index=0, stage_versions=[0],
                             version_spans=[], sampling_seed=0, rollouts=[])
        assert transport.put_rollouts(group, timeout=1)
        assert transport.get_rollouts(timeout=1) == group
    finally:
        transport.close()
        stranger.shutdown()
        coordinator.shutdown()

