"""Calling a peer: the request signed (net/guard.py) and sent through the emulated link on a
stream of its own (over a relay only where the connection has room, net/circuits.py; by the
peer's routes where the daemon cannot dial it, net/routing.py), the reply read within its RPC's
limit and checked, and asked for again, with the same request id, when the stream closed before
all of it came. Every call has a timeout: nothing waits forever on a peer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import runtime_pb2

from decentrl.errors import DecentrlError
from decentrl.net.circuits import REPLY_ROOM, Circuit, Circuits
from decentrl.net.daemon import Daemon
from decentrl.net.guard import Guard, ReplyContentError
from decentrl.net.link import MessageLost
from decentrl.net.protocol import Rpc
from decentrl.net.routing import Routing
from decentrl.net.streams import ErrorFrame, FrameReader, write_frame
from decentrl.net.wire import ActivationCodec, WireError, message_bytes

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
TRUNCATED_REPLY_RETRIES = 3
# Off loopback, the longest a stream may take to open before the peer's routes are tried.
OPEN_TIMEOUT_S = 3.0
# Peers a stream opened to that are remembered: identities are free.
PEERS_REACHED_KEPT = 1024


class RemoteError(DecentrlError, RuntimeError):
    """A peer answered with an error, or did not answer in time, or could not be reached."""


class PeerRefused(RemoteError):
    """The peer is alive and answered, with an error: it refused this request."""


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Caller:
    """The calls of one node (its daemon, its guard) to other peers."""

    def __init__(self, daemon: Daemon, guard: Guard, circuits: Circuits,
                 routing: Routing) -> None:
        self.daemon = daemon
        self.guard = guard
        self.circuits = circuits
        self.routing = routing
        self._reached: OrderedDict[str, None] = OrderedDict()  # peers a stream opened to

    async def call(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
                   tensors: Mapping[str, torch.Tensor] | None = None,
                   codec: ActivationCodec = "fp32", timeout: float = 30.0,
                   request_id: str | None = None,
                   exact: Mapping[str, torch.Tensor] | None = None
                   ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """One `rpc` request to `peer` through its emulated link: `tensors` go with `codec` (the
        activations), `exact` in full precision (log-probs, advantages). Returns the reply body,
        decoded as the RPC's reply, and its tensors. A reply that arrives incomplete is asked for
        again (same request id) a few times. Raises PeerRefused (the peer answered with an
        error), RemoteError (it timed out or could not be reached), MessageLost (the emulated
        link dropped the request), or WireError (the reply was over the RPC's reply limit,
        malformed, or not signed by `peer`: SignatureError; a ReplyContentError where `peer`
        did sign it, so its content, such as non-finite values or tensors the RPC never replies
        with, is its own doing)."""
        links = self.daemon.links
        assert links is not None
        method = rpc.method
        request_id = request_id or secrets.token_hex(8)
        requests = self.guard.signed_request(rpc, body, request_id, tensors, codec, exact)
        reply_limit = self.guard.reply_limit(rpc)
        link = links.link(peer)
        try:
            async with asyncio.timeout(timeout):
                await links.uplink.send(message_bytes(requests), peer)
                await link.send(message_bytes(requests), "out")
                for attempt in range(TRUNCATED_REPLY_RETRIES + 1):
                    responses = await self._exchange(peer, method, requests, reply_limit)
                    try:
                        reply_body, reply_tensors = self.guard.open_reply(responses, peer,
                                                                          method, request_id)
                        break
                    except WireError as error:
                        # Seen on loopback about once in a thousand streams under load, with
                        # live peers: the stream closes before the whole reply (or any of it)
                        # came through (its signature then fails too). Sending the request again
                        # with the same id is safe (the peer's reply cache answers it without a
                        # second run); a reply that is malformed every time is the peer's fault,
                        # and raised, as is one it signed (the same again).
                        if attempt == TRUNCATED_REPLY_RETRIES \
                                or isinstance(error, ReplyContentError):
                            raise
                        log.info("%s: %s at %s: incomplete reply (%s); asking again",
                                 self.daemon.name, method, peer[-8:], error)
                        await asyncio.sleep(0.05 * 2 ** attempt)
                await link.send(message_bytes(responses), "in")
        except MessageLost:
            raise  # the caller may retry the same peer with the same request id
        except TimeoutError as error:
            raise RemoteError(f"{method} at {peer[-8:]}: no answer within {timeout:.0f}s"
                              ) from error
        except ErrorFrame as error:  # its text is cut and made inert (net/streams.py)
            raise PeerRefused(f"{method} at {peer[-8:]}: {error}") from None
        except (ConnectionError, OSError, asyncio.IncompleteReadError, P2PDaemonError) as error:
            # P2PDaemonError includes its subclasses: ControlFailure is a peer we cannot dial.
            raise RemoteError(f"{method} at {peer[-8:]}: {error}") from error
        return self.guard.reply_of(rpc, peer, reply_body, reply_tensors)

    async def _exchange(self, peer: str, method: str, requests: list[runtime_pb2.ExpertRequest],
                        reply_limit: int) -> list[runtime_pb2.ExpertResponse]:
        """One stream to `peer`'s `method`: the request out, the reply back, never more than
        `reply_limit` bytes of it (FrameRefused, a WireError). ErrorFrame if the peer refused.
        Over a relay, only on a connection with room for it (net/circuits.py)."""
        circuit = self.circuits.get(peer)
        if circuit is not None:
            return await self._relayed(peer, circuit, method, requests, reply_limit)
        try:
            stream = await self._open(peer, method)
        except P2PDaemonError:
            # Not connected, and the daemon found no way to dial it: the peer's own routes (on
            # loopback every peer is dialable, and one that is not is gone).
            if self.daemon.network.reachability == "loopback" \
                    or not await self.routing.connect(peer):
                raise
            circuit = self.circuits.get(peer)
            if circuit is not None:  # a route through a relay
                return await self._relayed(peer, circuit, method, requests, reply_limit)
            stream = await self._open(peer, method)
        return await self._talk(stream, method, requests, reply_limit)

    async def _relayed(self, peer: str, circuit: Circuit, method: str,
                       requests: list[runtime_pb2.ExpertRequest], reply_limit: int
                       ) -> list[runtime_pb2.ExpertResponse]:
        """The call over the relayed connection to `peer`, or over a direct one the daemon holds
        by now (then `circuit` is forgotten: new streams take it)."""
        request_bytes = message_bytes(requests)
        reply_room = min(reply_limit, REPLY_ROOM)
        retried = False
        while True:
            direct = await circuit.take_room(
                peer, method, request_bytes, reply_room,
                connections=lambda: self.daemon.connections(peer),
                renew=lambda: self.routing.renew_circuit(peer, circuit))
            if direct:
                self.circuits.forget(peer)
                return await self._talk(await self._open(peer, method), method, requests,
                                        reply_limit)
            sent = received = 0
            try:
                stream = await self._open(peer, method)
                sent = request_bytes
                self.circuits.relayed_bytes_sent += request_bytes
                responses = await self._talk(stream, method, requests, reply_limit)
                received = message_bytes(responses)
                return responses
            except P2PDaemonError:
                # The relay dropped the connection before the stream opened: once more, on a
                # fresh one.
                circuit.broken = True
                if retried:
                    raise
                retried = True
            except ErrorFrame:  # refused: the connection is fine
                raise
            except BaseException:
                circuit.broken = True
                self.circuits.failures += 1
                raise
            finally:
                await circuit.release(request_bytes, reply_room, sent, received)

    async def _open(self, peer: str, method: str) -> Stream:
        """A stream to `peer`'s `method`. Off loopback, to a peer never reached before or
        reached through a relay, P2PDaemonError also when the daemon takes over OPEN_TIMEOUT_S:
        it is dialing addresses of the peer's that nobody outside its LAN can reach (a peer
        behind NAT), which fails only after seconds; the peer's routes come next. (Opening a
        stream on a live connection is quick, but may wait for a busy daemon: not timed.)"""
        opening = self.daemon.running.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                 f"decentrl.{method}")
        if self.daemon.network.reachability == "loopback" \
                or (peer in self._reached and self.circuits.get(peer) is None):
            _, reader, writer = await opening
            return reader, writer
        try:
            _, reader, writer = await asyncio.wait_for(opening, OPEN_TIMEOUT_S)
        except TimeoutError:
            raise P2PDaemonError(f"no stream to {peer[-8:]} within {OPEN_TIMEOUT_S:.0f}s") \
                from None
        self._reached[peer] = None
        self._reached.move_to_end(peer)
        while len(self._reached) > PEERS_REACHED_KEPT:  # identities are free: bounded
            self._reached.popitem(last=False)
        return reader, writer

    @staticmethod
    async def _talk(stream: Stream, method: str, requests: list[runtime_pb2.ExpertRequest],
                    reply_limit: int) -> list[runtime_pb2.ExpertResponse]:
        reader, writer = stream
        with contextlib.closing(writer):
            sending = asyncio.create_task(_send_requests(writer, requests))
            # A peer that refuses before reading the whole request may reset the stream under
            # the sender: what counts is the answer read below.
            sending.add_done_callback(_retrieve_outcome)
            try:
                return await FrameReader(reader, f"{method} reply", reply_limit, None).replies(
                    runtime_pb2.ExpertResponse)
            finally:
                sending.cancel()


async def _send_requests(writer: asyncio.StreamWriter,
                         requests: list[runtime_pb2.ExpertRequest]) -> None:
    for request in requests:
        await write_frame(writer, request, None)
    await write_frame(writer, P2P.END_OF_STREAM, None)


def _retrieve_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
