"""Serving RPCs: each request on a stream of its own, read within bounds, answered through its
guarded handler (net/guard.py), its reply remembered for a retry, and a strike against a sender
whose request was its own fault.

Nothing a peer sends is read past a bound. A request's bytes are capped per RPC (net/protocol.py:
a number, or a function of the run's sizes), and a message header that declares more is refused
before any of the message is read. A stream that sends nothing for `read_timeout_s` is cut, and
one sender may have at most `max_streams_per_sender` requests open at once (past it they are
refused, no strike: an honest caller with many sessions can get there; past twice it, the sender
is flooding: a strike, and the stream is cut unanswered). All senders together hold at most
`inflight` bytes of requests (net/inflight_budget.py): a message past it is refused as busy,
before it is read, no strike. Before any of a request is read, its sender must not be blocked
(net/strikes.py) and must pass the callers policy.

A refusal strikes the sender only where it says so (decentrl/errors.py `SenderFault`: a request
that does not decode, is unsigned or over a limit, a caller the policy refuses, a handler's
explicit fault); anything else a handler raises is answered as an error and logged, no strike.
The request id travels in the `uid` field: replies are remembered by sender and id, so a caller
that retries after a lost reply gets the same answer instead of running the request twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from decentrl.errors import DecentrlError, SenderFault, strikes_sender
from decentrl.net.circuits import Circuits
from decentrl.net.daemon import Daemon
from decentrl.net.guard import Guarded
from decentrl.net.inflight_budget import InflightBudget
from decentrl.net.reach import through_relay
from decentrl.net.route_screen import RouteScreen
from decentrl.net.streams import FrameReader, StreamStalled, write_frame
from decentrl.net.strikes import Strikes
from decentrl.net.text import peer_text
from decentrl.net.wire import MAX_MESSAGE_BYTES, message_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

# Replies kept for retried requests, per callers class of the RPC (net/authority.py); activations
# are a few MiB, so a short memory.
REPLY_CACHE_SIZE = 16
# The longest a request stream may send nothing (before or inside its request), or leave a piece
# of its reply unread, before it is cut.
READ_TIMEOUT_S = 10.0
# Requests one sender may have open at a node at once, those waiting for the compute thread
# included.
MAX_STREAMS_PER_SENDER = 32
Responses = list[runtime_pb2.ExpertResponse]


class TooManyStreams(DecentrlError, RuntimeError):
    """A request refused unread: its sender has too many requests open at this node already."""


class CallerLeft(DecentrlError):
    """The caller closed its stream before its answer was ready."""


class Server:
    """The RPCs one node serves (on its loop), and the state of its open request streams."""

    def __init__(self, daemon: Daemon, strikes: Strikes, circuits: Circuits,
                 route_screen: RouteScreen, read_timeout_s: float = READ_TIMEOUT_S,
                 max_streams_per_sender: int = MAX_STREAMS_PER_SENDER) -> None:
        if read_timeout_s <= 0 or max_streams_per_sender < 1:
            raise ValueError(f"need read_timeout_s > 0, max_streams_per_sender >= 1; got "
                             f"{read_timeout_s}, {max_streams_per_sender}")
        self.daemon = daemon
        self.strikes = strikes
        self.circuits = circuits
        self.route_screen = route_screen
        self.read_timeout_s = read_timeout_s
        self.max_streams_per_sender = max_streams_per_sender
        # Bytes of requests held at once, all senders together (net/inflight_budget.py).
        self.inflight = InflightBudget()
        self._open_streams: dict[str, int] = {}  # sender -> requests open here
        # By the RPC's callers class, then (sender, request id): a request id is the caller's
        # choice, so another peer that learnt it must not get the caller's reply. A class of its
        # own for the run owner's RPCs: strangers with many keys, who may call the open ones,
        # cannot evict its replies (a retried lost reply would run twice).
        self._replies: dict[str, OrderedDict[tuple[str, str], asyncio.Future[Responses]]] = {}

    async def serve(self, guarded: Guarded[Any], request_limit: int) -> None:
        """Serve `guarded.rpc` with it, reading at most `request_limit` bytes of a request."""
        rpc = guarded.rpc

        async def handle_stream(info: StreamInfo, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
            sender = str(info.peer_id)
            self.route_screen.saw(sender, str(info.addr))
            stream = FrameReader(reader, f"{rpc.method} request", request_limit,
                                 self.read_timeout_s, self.inflight)
            with contextlib.closing(writer):
                try:
                    await self._serve_stream(guarded, sender, str(info.addr), stream, writer)
                finally:
                    stream.release()

        await self.daemon.running.add_binary_stream_handler(f"decentrl.{rpc.method}",
                                                            handle_stream)

    async def unserve(self, method: str) -> None:
        """Stop serving `method`; logged if the daemon will not."""
        try:
            await self.daemon.running.remove_binary_stream_handler(f"decentrl.{method}")
        except P2PDaemonError as error:
            log.warning("%s: could not stop serving %s: %s", self.daemon.name, method, error)

    def open_streams(self, peer: str) -> int:
        """`peer`'s requests open at this node now (counted on the loop thread)."""
        return self._open_streams.get(peer, 0)

    async def _serve_stream(self, guarded: Guarded[Any], sender: str, address: str,
                            stream: FrameReader, writer: asyncio.StreamWriter) -> None:
        method = guarded.rpc.method
        open_streams = self._open_streams.get(sender, 0) + 1
        self._open_streams[sender] = open_streams
        try:
            if open_streams > 2 * self.max_streams_per_sender:
                self.strikes.strike(sender, method, TooManyStreams(
                    f"{open_streams} requests open at once; the stream is cut unanswered"))
                return
            try:
                responses = await self._answer(guarded, sender, address, stream, open_streams)
            except CallerLeft:
                return
            except StreamStalled as error:
                log.info("%s: %s from %s cut: %s", self.daemon.name, method, sender[-8:], error)
                await write_frame(writer, RPCError(message=str(error)), self.read_timeout_s)
                return
            except Exception as error:  # a refusal: the caller gets its text
                await write_frame(writer, RPCError(message=str(error)), self.read_timeout_s)
                await stream.discard_rest(MAX_MESSAGE_BYTES)
                return
            for response in responses:
                await write_frame(writer, response, self.read_timeout_s)
        except (ConnectionError, TimeoutError) as error:  # the caller left, or stopped reading
            log.info("%s: %s from %s: could not answer: %r", self.daemon.name, method,
                     sender[-8:], error)
        finally:
            # The count now, not the one this stream saw: others opened and closed meanwhile.
            still_open = self._open_streams.get(sender, 1) - 1
            if still_open > 0:
                self._open_streams[sender] = still_open
            else:
                self._open_streams.pop(sender, None)

    async def _answer(self, guarded: Guarded[Any], sender: str, address: str,
                      stream: FrameReader, open_streams: int) -> Responses:
        """The reply to the request on `stream`, or the refusal raised (its text goes back)."""
        method = guarded.rpc.method
        if open_streams > self.max_streams_per_sender:
            raise TooManyStreams(f"{method}: peer {sender[-8:]} has "
                                 f"{self.max_streams_per_sender} requests open here already")
        try:
            self.strikes.refuse_if_blocked(sender)
            await guarded.admit(sender)
            messages = await stream.requests(runtime_pb2.ExpertRequest)
            if messages is None:
                raise CallerLeft
            request = guarded.open(sender, messages)
        except SenderFault as error:  # WireError, SignatureError and CallerRefused included
            self.strikes.strike(sender, method, error)
            raise
        # A retried request (its reply was lost) gets the first answer, not a second run.
        key = (sender, request.request_id)
        replies = self._replies.setdefault(guarded.rpc.callers, OrderedDict())
        cached = replies.get(key) if request.request_id else None
        if cached is None:
            cached = asyncio.get_running_loop().create_future()
            if request.request_id:
                replies[key] = cached
                while len(replies) > REPLY_CACHE_SIZE:
                    replies.popitem(last=False)
            try:
                cached.set_result(await _unless_caller_leaves(
                    stream, guarded.answer(request, sender, address)))
            except (asyncio.CancelledError, CallerLeft):
                log.warning("%s: %s from %s cancelled mid-request", self.daemon.name, method,
                            sender[-8:])
                replies.pop(key, None)
                cached.cancel()
                raise
            except Exception as error:
                account_refusal(self.strikes, self.daemon.name, sender, method, error)
                # A refusal that is the sender's fault stays, so a retry of this signed request
                # (its reply was lost) is refused again without a second strike; any other may
                # pass if asked again (the peer was busy, or failed here).
                if not strikes_sender(error):
                    replies.pop(key, None)
                cached.set_exception(error)
                cached.exception()  # retrieved here; the caller gets it below
        responses = await asyncio.shield(cached)
        assert self.daemon.links is not None
        await self.daemon.links.uplink.send(message_bytes(responses), sender)
        if through_relay(address):
            self.circuits.relayed_bytes_sent += message_bytes(responses)
        self.circuits.seen(sender, address, message_bytes(messages), message_bytes(responses))
        return responses


def account_refusal(strikes: Strikes, name: str, sender: str, method: str,
                    error: Exception) -> None:
    """Account for a request its handler (or the checks before it) did not answer: a strike
    where the error says the sender was at fault; otherwise a refusal the handler meant (a
    timeout, a peer busy), or this peer's own failure, which is not held against the sender."""
    if strikes_sender(error):
        strikes.strike(sender, method, error)
    elif isinstance(error, DecentrlError):
        log.info("%s: %s from %s refused: %s", name, method, sender[-8:], peer_text(error))
    else:
        log.warning("%s: %s from %s failed here: %s", name, method, sender[-8:],
                    peer_text(f"{type(error).__name__}: {error}"))


async def _unless_caller_leaves(stream: FrameReader, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; CallerLeft, and `work` cancelled, if the caller closes its stream first
    (it gave up: a retry comes on another stream)."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(stream.wait_closed())
    try:
        await asyncio.wait((task, left), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise CallerLeft
        return task.result()
    finally:
        left.cancel()
        task.cancel()
