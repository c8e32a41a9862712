"""The `local` mode of the swarm's protocols: nodes in one process, no p2p daemon, for fast tests.

A `LocalNode` is a `SwarmNode` whose transport is a function call. What a request meets on its
way is what it meets over the daemons: the caller signs it (net/guard.py) and sends it through
its emulated link and uplink (net/link.py: delay, jitter, bandwidth); the callee's strikes and
callers policy admit the sender, the request's size is checked against the RPC's limit, its
signature and body against the RPC, and its handler runs on the callee's own loop and compute
thread; the reply comes back signed, through the callee's uplink and the link, and is opened
and checked by the caller. Every node keeps its own event loop thread, as a process would, so
a handler that calls on (a stage pushing to the next) does so across loops.

What it leaves out is the stream layer (net/serving.py, net/streams.py, net/circuits.py):
stream counts and read timeouts, the reply cache, relays and NAT. So a link that loses messages
is refused here (a lost reply would run its request twice without the reply cache), and the DHT
is one table shared by the network's nodes, which keeps each writer's latest record under a key
until it expires; records are authentic because only the node itself writes under its id."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from hivemind.proto import runtime_pb2

from decentrl.errors import SenderFault
from decentrl.net.calls import PeerRefused, RemoteError
from decentrl.net.guard import Guarded, Handler
from decentrl.net.identity import Identity
from decentrl.net.link import LinkEmulator, LinkProfile, MessageLost
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import Rpc
from decentrl.net.reach import RouteRecord, check_route_record, route_key
from decentrl.net.records import MAX_RECORD_BYTES
from decentrl.net.serving import account_refusal
from decentrl.net.strikes import BLOCK_S, STRIKES_TO_BLOCK
from decentrl.net.text import peer_text
from decentrl.net.wire import (
    ActivationCodec,
    TensorLimits,
    WireError,
    decode_struct,
    encode_struct,
    message_bytes,
)

Req = TypeVar("Req")
Rep = TypeVar("Rep")
Responses = list[runtime_pb2.ExpertResponse]
LOCAL_ADDRESS = "local"  # what a handler sees as a local caller's address


class LocalNetwork:
    """The nodes of one in-process swarm, and the table that stands in for their DHT."""

    def __init__(self) -> None:
        self.nodes: dict[str, LocalNode] = {}
        # key -> writer -> (value, expiry in wall-clock seconds, as the DHT's)
        self._records: dict[str, dict[str, tuple[bytes, float]]] = {}
        self._lock = threading.Lock()

    def start_node(self, name: str, link_profile: LinkProfile = LinkProfile(),
                   limits: TensorLimits = TensorLimits(), identity: Identity | None = None,
                   strikes_to_block: int = STRIKES_TO_BLOCK, block_s: float = BLOCK_S
                   ) -> LocalNode:
        """A started node on this network (its loop and compute threads running)."""
        node = LocalNode(self, name, link_profile, limits, identity, strikes_to_block, block_s)
        node._thread.start()
        self.nodes[node.peer_id] = node
        return node

    def store(self, key: str, writer: str, value: bytes, ttl_s: float) -> None:
        with self._lock:
            self._records.setdefault(key, {})[writer] = (value, time.time() + ttl_s)

    def find(self, key: str) -> dict[str, bytes]:
        now = time.time()
        with self._lock:
            return {writer: value for writer, (value, expiry) in
                    self._records.get(key, {}).items() if expiry > now}


class LocalNode(SwarmNode):
    """A node of a `LocalNetwork`: start it with `LocalNetwork.start_node`."""

    def __init__(self, network: LocalNetwork, name: str, link_profile: LinkProfile,
                 limits: TensorLimits, identity: Identity | None, strikes_to_block: int,
                 block_s: float) -> None:
        super().__init__(name, link_profile, limits, identity=identity,
                         strikes_to_block=strikes_to_block, block_s=block_s)
        self.local_network = network
        self._served: dict[str, tuple[Guarded[Any], int]] = {}
        self._use(link_profile)

    def _use(self, link_profile: LinkProfile) -> None:
        if link_profile.loss > 0.0:
            raise ValueError(f"{self.name}: local mode emulates delay and bandwidth, not loss "
                             f"({link_profile.loss}): a lost reply would run its request again "
                             f"without the stream layer's reply cache; use SwarmNode")
        self.daemon.link_profile = link_profile
        self.daemon.links = LinkEmulator(local=self.peer_id, profile=link_profile)

    # ---- what a daemon would have told ---------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def addresses(self) -> list[str]:
        return [f"{LOCAL_ADDRESS}/{self.peer_id}"]

    def peer_hosts(self) -> dict[str, str]:
        return {}  # no connection was observed: every peer is on this host

    def socket_paths(self) -> list[str]:
        return []

    def configure(self, link_profile: LinkProfile, compute_threads: int | None) -> None:
        self._use(link_profile)
        if compute_threads:
            torch.set_num_threads(compute_threads)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.local_network.nodes.pop(self.peer_id, None)
        if self._thread.is_alive():
            async def stop() -> None:
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.wait(others, timeout=2) if others else None
            self.run(stop(), timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.compute_thread.shutdown()

    # ---- serving and calling -------------------------------------------------------------

    def serve(self, rpc: Rpc[Req, Any], handler: Handler[Req]) -> None:
        self._served[rpc.method] = (self.guard.wrap(rpc, handler), self.guard.request_limit(rpc))

    def unserve(self, rpc: Rpc[Any, Any]) -> None:
        self._served.pop(rpc.method, None)

    async def call(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
                   tensors: Mapping[str, torch.Tensor] | None = None,
                   codec: ActivationCodec = "fp32", timeout: float = 30.0,
                   request_id: str | None = None,
                   exact: Mapping[str, torch.Tensor] | None = None
                   ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """As `SwarmNode.call`, the callee reached in this process."""
        links = self.links
        assert links is not None
        method = rpc.method
        requests = self.guard.signed_request(rpc, body, request_id or secrets.token_hex(8), tensors,
                                             codec, exact)
        request_id = requests[0].uid
        link = links.link(peer)
        try:
            async with asyncio.timeout(timeout):
                await links.uplink.send(message_bytes(requests), peer)
                await link.send(message_bytes(requests), "out")
                callee = self.local_network.nodes.get(peer)
                if callee is None or callee.closed:
                    raise RemoteError(f"{method} at {peer[-8:]}: no such peer on this network")
                try:
                    responses = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                        callee._answer(self.peer_id, method, requests), callee.loop))
                except (RemoteError, MessageLost):
                    raise
                except Exception as error:  # the callee's refusal, as its error frame says
                    raise PeerRefused(f"{method} at {peer[-8:]}: {peer_text(error)}") from None
                if message_bytes(responses) > self.guard.reply_limit(rpc):
                    raise WireError(f"{method} at {peer[-8:]}: a reply of "
                                    f"{message_bytes(responses)} bytes, over its limit")
                reply_body, reply_tensors = self.guard.open_reply(responses, peer, method,
                                                                  request_id)
                await link.send(message_bytes(responses), "in")
        except TimeoutError as error:
            raise RemoteError(f"{method} at {peer[-8:]}: no answer within {timeout:.0f}s"
                              ) from error
        return self.guard.reply_of(rpc, peer, reply_body, reply_tensors)

    async def _answer(self, sender: str, method: str,
                      requests: list[runtime_pb2.ExpertRequest]) -> Responses:
        """`sender`'s request, admitted and answered as net/serving.py does (on this loop)."""
        served = self._served.get(method)
        if served is None:
            raise RemoteError(f"{self.name} does not serve {method}")
        guarded, request_limit = served
        try:
            self.strike_book.refuse_if_blocked(sender)
            await guarded.admit(sender)
            if message_bytes(requests) > request_limit:
                raise WireError(f"{method}: a request of {message_bytes(requests)} bytes, over "
                                f"its limit of {request_limit}")
            request = guarded.open(sender, requests)
        except SenderFault as error:
            self.strike_book.strike(sender, method, error)
            raise
        try:
            responses = await guarded.answer(request, sender, LOCAL_ADDRESS)
        except Exception as error:
            account_refusal(self.strike_book, self.name, sender, method, error)
            raise
        assert self.links is not None
        await self.links.uplink.send(message_bytes(responses), sender)
        return responses

    # ---- the DHT, as one shared table ----------------------------------------------------

    async def announce(self, key: str, value: bytes, ttl_s: float) -> bool:
        self.dht_storage.check_ttl(key, ttl_s)
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"{self.name}: a record of {len(value)} bytes under {key!r} is "
                             f"over the DHT's limit of {MAX_RECORD_BYTES}")
        self.local_network.store(key, self.peer_id, value, ttl_s)
        return True

    async def lookup(self, key: str) -> dict[str, bytes]:
        return self.local_network.find(key)

    async def announce_routes(self, record: RouteRecord, ttl_s: float) -> bool:
        check_route_record(record)
        return await self.announce(route_key(self.peer_id), encode_struct(record), ttl_s)

    async def routes_of(self, peer: str) -> RouteRecord | None:
        value = (await self.lookup(route_key(peer))).get(peer)
        if value is None:
            return None
        try:
            return decode_struct(value, RouteRecord)
        except WireError:
            return None

    @property
    def refused_records(self) -> dict[str, int]:
        return {}

