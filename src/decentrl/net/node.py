"""One process's presence on the swarm: a `SwarmNode` runs an asyncio loop in a background thread
so that synchronous code (the generation loop, the trainer driver) can call peers while the loop
keeps serving them, and is made of one part per job:

- net/daemon.py `Daemon`: the hivemind p2p daemon under the node's Ed25519 key (net/identity.py),
  the DHT node sharing it, the emulated links (net/link.py); a node behind NAT re-dials its
  initial peers.
- net/guard.py `Guard`: the wrapper around every handler and every call: the callers policy
  (net/authority.py), signatures (net/signing.py), the size and shape of what comes in.
- net/serving.py `Server`: request streams read within bounds, the reply cache, the in-flight
  budget; net/strikes.py `Strikes`: strikes and blocks against senders at fault.
- net/calls.py `Caller`: outgoing calls, asked again when a reply comes in cut short.
- net/circuits.py `Circuits`: what each connection through a relay may still carry.
- net/routing.py `Routing`: this node's DHT records, and the routes by which it reaches a peer.

Every RPC is a stream in hivemind's protobuf framing, read by our own bounded reader
(net/streams.py): requests and replies are `ExpertRequest`/`ExpertResponse` messages whose
metadata is a msgspec struct and whose tensors go through hivemind's codecs (net/wire.py),
chunked under the 4 MiB message cap. What the node keeps for the DHT is bounded by
net/dht_storage.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from decentrl.net.authority import CallerPolicy
from decentrl.net.calls import Caller, PeerRefused, RemoteError
from decentrl.net.circuits import Circuits
from decentrl.net.compute import ComputeThread, Priority
from decentrl.net.daemon import (
    LOOPBACK_ONLY,
    STARTUP_TIMEOUT_S,
    Daemon,
    SwarmStartError,
    check_peer_addresses,
    start_daemon,
)
from decentrl.net.dht_storage import BoundedDHTStorage
from decentrl.net.guard import Guard, Handler, Reply, ReplyContentError, Request
from decentrl.net.identity import Identity
from decentrl.net.link import LinkEmulator, LinkProfile, MessageLost
from decentrl.net.protocol import Rpc
from decentrl.net.reach import NetworkOptions, RouteRecord
from decentrl.net.records import SignedRecordValidator
from decentrl.net.route_screen import RouteScreen
from decentrl.net.routing import Routing
from decentrl.net.serving import MAX_STREAMS_PER_SENDER, READ_TIMEOUT_S, Server
from decentrl.net.sizes import RunSizes
from decentrl.net.strikes import BLOCK_S, STRIKE_WINDOW_S, STRIKES_TO_BLOCK, Strikes
from decentrl.net.wire import ActivationCodec, TensorLimits

# The names the rest of the code imports from here: the node, and what its users handle.
__all__ = [
    "LOOPBACK_ONLY", "Handler", "PeerRefused", "RemoteError", "Reply", "ReplyContentError",
    "Request", "SwarmNode", "SwarmStartError", "check_peer_addresses", "start_daemon",
]

log = logging.getLogger(__name__)
# A start whose initial peers refuse it tries again, a few times, a moment apart: a peer that
# has just started, or a home router that has just opened its mapping, can refuse the first
# connection (seen in CI, a peer behind the netns NAT of tests/netns/test_netns_links.py).
BOOTSTRAP_ATTEMPTS = 3
BOOTSTRAP_PAUSE_S = 2.0
T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")


class SwarmNode:
    """Start with `SwarmNode.start(...)`; `shutdown()` stops the daemon and removes its socket."""

    def __init__(self, name: str, link_profile: LinkProfile, limits: TensorLimits,
                 compute_threads: int | None = None, identity: Identity | None = None,
                 strikes_to_block: int = STRIKES_TO_BLOCK,
                 strike_window_s: float = STRIKE_WINDOW_S, block_s: float = BLOCK_S,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 max_streams_per_sender: int = MAX_STREAMS_PER_SENDER) -> None:
        self.name = name
        self.limits = limits
        self.identity = identity or Identity.generate()
        self.strike_book = Strikes(name, strikes_to_block, strike_window_s, block_s)
        self.guard = Guard(self.identity, limits)
        self.daemon = Daemon(name, self.identity, link_profile)
        self.record_validator = SignedRecordValidator(self.identity)
        # What this node keeps for the DHT (net/dht_storage.py): its run's keys only, once it
        # joins one (`dht_storage.join`), within budgets per writer, per key and in total.
        self.dht_storage = BoundedDHTStorage()
        # Peers reached through a relay, and what their connections carried (net/circuits.py).
        self.circuits = Circuits()
        self.route_screen = RouteScreen()  # which announced routes may be dialed
        self.routing = Routing(self.daemon, self.circuits, self.record_validator,
                               self.dht_storage, self.route_screen)
        self.server = Server(self.daemon, self.strike_book, self.circuits, self.route_screen,
                             read_timeout_s, max_streams_per_sender)
        self.calls = Caller(self.daemon, self.guard, self.circuits, self.routing)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"p2p-{name}", daemon=True)
        # One compute thread: requests run one at a time, the most urgent first, and the loop
        # stays free to serve the DHT, timeouts and other calls meanwhile.
        # torch's intra-op thread count is per thread under OpenMP: set it where the work runs.
        self.compute_thread = ComputeThread(
            name, (lambda: torch.set_num_threads(compute_threads)) if compute_threads else None)
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    def start(cls, name: str, initial_peers: Sequence[str], link_profile: LinkProfile,
              limits: TensorLimits, network: NetworkOptions = LOOPBACK_ONLY,
              compute_threads: int | None = None,
              identity: Identity | None = None, strikes_to_block: int = STRIKES_TO_BLOCK,
              strike_window_s: float = STRIKE_WINDOW_S, block_s: float = BLOCK_S,
              read_timeout_s: float = READ_TIMEOUT_S,
              max_streams_per_sender: int = MAX_STREAMS_PER_SENDER) -> SwarmNode:
        check_peer_addresses(initial_peers)
        node = cls(name, link_profile, limits, compute_threads, identity, strikes_to_block,
                   strike_window_s, block_s, read_timeout_s, max_streams_per_sender)
        node._thread.start()
        try:
            node.route_screen.know_relays([*initial_peers, *network.relays])
            node._start_daemon(list(initial_peers), network)
        except BaseException:
            node.shutdown()
            raise
        return node

    def _start_daemon(self, initial_peers: list[str], network: NetworkOptions) -> None:
        """Start the daemon, up to BOOTSTRAP_ATTEMPTS times while none of `initial_peers`
        answers: a peer that has just started (or whose router has just opened its mapping)
        sometimes refuses the first connection, and one refusal should not end a start."""
        for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
            try:
                self.run(self.daemon.start(initial_peers, network, self.record_validator,
                                           self.dht_storage), timeout=STARTUP_TIMEOUT_S)
                return
            except P2PDaemonError as error:
                if "failed to connect to bootstrap peers" not in str(error):
                    raise SwarmStartError(f"the p2p daemon did not start: {error}") from None
                if attempt == BOOTSTRAP_ATTEMPTS:
                    raise SwarmStartError(
                        f"none of the initial peers answered ({', '.join(initial_peers)}) in "
                        f"{BOOTSTRAP_ATTEMPTS} attempts: check that the peer is running and that "
                        "the address is the one it printed") from None
                log.info("%s: none of the initial peers answered; attempt %d of %d in %.0fs",
                         self.name, attempt + 1, BOOTSTRAP_ATTEMPTS, BOOTSTRAP_PAUSE_S)
                time.sleep(BOOTSTRAP_PAUSE_S)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # Closed where it ran: a loop left to the garbage collector at the interpreter's
            # exit is closed after its selector's files and prints a traceback on stderr.
            self.loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def p2p(self) -> P2P | None:
        return self.daemon.p2p

    @property
    def dht(self) -> DHTNode | None:
        return self.daemon.dht

    @property
    def links(self) -> LinkEmulator | None:
        return self.daemon.links

    @property
    def link_profile(self) -> LinkProfile:
        return self.daemon.link_profile

    @property
    def network(self) -> NetworkOptions:
        return self.daemon.network

    @property
    def peer_id(self) -> str:
        return str(self.daemon.running.peer_id)

    def addresses(self) -> list[str]:
        return [str(a) for a in self.run(self.daemon.running.get_visible_maddrs(), timeout=30)]

    def peer_hosts(self) -> dict[str, str]:
        """Each connected peer's host as this node's daemon observed the connection, not as the
        peer claims it: a direct connection's, else its relay's (net/probation.py)."""
        try:
            return self.run(self.daemon.peer_hosts(), timeout=10)
        except TimeoutError:
            return {}

    def socket_paths(self) -> list[str]:
        """The daemon's unix sockets (removed on shutdown; a killed process leaves them)."""
        return self.daemon.socket_paths()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            async def stop() -> None:
                await self.daemon.stop()
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.wait(others, timeout=2) if others else None
            try:
                self.run(stop(), timeout=30)
            except Exception as error:  # noqa: BLE001 - shutting down anyway
                log.warning("%s: shutdown: %s", self.name, error)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.compute_thread.shutdown()

    # ---- running coroutines from other threads ------------------------------------------

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run a coroutine on the node's loop from another thread, waiting at most `timeout`."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("SwarmNode.run called from its own loop; await instead")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def configure(self, link_profile: LinkProfile, compute_threads: int | None) -> None:
        """Take a run's link emulation and thread count after starting (a peer that learns its
        run's config from the swarm), before it serves or calls anyone."""
        self.daemon.use_link_profile(link_profile)
        if compute_threads:
            self.compute_thread.submit(Priority.TRAINING, torch.set_num_threads,
                                       compute_threads).result(timeout=30)

    async def compute(self, fn: Callable[..., T], *args: Any, priority: Priority) -> T:
        """Run blocking work (a forward pass) on the compute thread, after any more urgent work
        that waits (net/compute.py)."""
        return await asyncio.wrap_future(self.compute_thread.submit(priority, fn, *args),
                                         loop=self.loop)

    # ---- what the node admits (net/guard.py, net/strikes.py) ------------------------------

    @property
    def sizes(self) -> RunSizes | None:
        """The run's sizes, which bound the activations and micro-batches its RPCs carry."""
        return self.guard.sizes

    @sizes.setter
    def sizes(self, sizes: RunSizes | None) -> None:
        self.guard.sizes = sizes

    @property
    def authorize(self) -> CallerPolicy:
        """Who may call what (net/authority.py RunAuthority.check once it serves a run)."""
        return self.guard.authorize

    @authorize.setter
    def authorize(self, policy: CallerPolicy) -> None:
        self.guard.authorize = policy

    @property
    def on_strike(self) -> Callable[[str, str], None] | None:
        """Called with (peer id, reason) on each strike, from the loop thread."""
        return self.strike_book.on_strike

    @on_strike.setter
    def on_strike(self, listener: Callable[[str, str], None] | None) -> None:
        self.strike_book.on_strike = listener

    @property
    def strikes_to_block(self) -> int:
        return self.strike_book.strikes_to_block

    @strikes_to_block.setter
    def strikes_to_block(self, strikes: int) -> None:
        self.strike_book.strikes_to_block = strikes

    @property
    def block_s(self) -> float:
        return self.strike_book.block_s

    @block_s.setter
    def block_s(self, seconds: float) -> None:
        self.strike_book.block_s = seconds

    def strikes(self, peer: str) -> int:
        """`peer`'s strikes within the strike window (0 while it is blocked)."""
        return self.strike_book.count(peer)

    def blocked(self, peer: str) -> bool:
        return self.strike_book.blocked(peer)

    # ---- serving (net/serving.py) --------------------------------------------------------

    def serve(self, rpc: Rpc[Req, Any], handler: Handler[Req]) -> None:
        """Serve `rpc` (net/protocol.py) with `handler`, wrapped in this node's guard: a request
        is refused before any of it is read if its sender has too many requests open here, is
        blocked, or may not call `rpc` (`authorize`); it is refused, and counted as a strike, as
        soon as a message header declares more than the RPC's size limit, and unless it is
        signed by its sender, its body decodes as the RPC's request and its tensors are the ones
        the RPC takes; only then does the handler run. A stream that sends nothing for
        `server.read_timeout_s` is cut."""
        request_limit = self.guard.request_limit(rpc)
        self.run(self.server.serve(self.guard.wrap(rpc, handler), request_limit), timeout=30)

    def unserve(self, rpc: Rpc[Any, Any]) -> None:
        """Stop serving `rpc`, so that another object on this node may serve it later (a
        restarted coordinator on the same node). A stopped node serves nothing anyway."""
        if self._closed or self.p2p is None:
            return
        try:
            self.run(self.server.unserve(rpc.method), timeout=30)
        except TimeoutError as error:
            log.warning("%s: could not stop serving %s: %s", self.name, rpc.method, error)

    def open_streams(self, peer: str) -> int:
        """`peer`'s requests open at this node now (counted on the loop thread)."""
        return self.server.open_streams(peer)

    @property
    def relayed_bytes_sent(self) -> int:
        """Of what this node sent, the bytes that crossed a relay."""
        return self.circuits.relayed_bytes_sent

    # ---- calling (net/calls.py) ----------------------------------------------------------

    async def call(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
                   tensors: Mapping[str, torch.Tensor] | None = None,
                   codec: ActivationCodec = "fp32", timeout: float = 30.0,
                   request_id: str | None = None,
                   exact: Mapping[str, torch.Tensor] | None = None
                   ) -> tuple[Rep, dict[str, torch.Tensor]]:
        """`Caller.call`: one `rpc` request to `peer`, its reply body and tensors."""
        return await self.calls.call(peer, rpc, body, tensors, codec, timeout, request_id, exact)

    def call_sync(self, peer: str, rpc: Rpc[Req, Rep], body: Req,
                  tensors: Mapping[str, torch.Tensor] | None = None,
                  codec: ActivationCodec = "fp32", timeout: float = 30.0,
                  request_id: str | None = None,
                  exact: Mapping[str, torch.Tensor] | None = None
                  ) -> tuple[Rep, dict[str, torch.Tensor]]:
        # The outer wait is a backstop: the call enforces `timeout` itself, unless this node's
        # loop is too starved to run it (a machine out of memory); then it is a lost message,
        # which callers retry or fail over like any other.
        try:
            return self.run(self.call(peer, rpc, body, tensors, codec, timeout, request_id,
                                      exact), timeout=timeout + 10)
        except TimeoutError:
            raise MessageLost(f"{rpc.method} at {peer[-8:]}: no answer within {timeout + 10:.0f}s "
                              f"(this node's event loop did not get to it)") from None

    # ---- the DHT and routes (net/routing.py) ---------------------------------------------

    async def announce(self, key: str, value: bytes, ttl_s: float) -> bool:
        """`Routing.announce`: `value` under `key` as this node's record, for `ttl_s`."""
        return await self.routing.announce(key, value, ttl_s)

    async def lookup(self, key: str) -> dict[str, bytes]:
        """`Routing.lookup`: every live record under `key`, by writer."""
        return await self.routing.lookup(key)

    async def announce_routes(self, record: RouteRecord, ttl_s: float) -> bool:
        """Tell the swarm how to dial this node (net/reach.py)."""
        return await self.routing.announce_routes(record, ttl_s)

    async def routes_of(self, peer: str) -> RouteRecord | None:
        """`peer`'s own route record, or None if it has none or it is malformed."""
        return await self.routing.routes_of(peer)

    @property
    def refused_records(self) -> dict[str, int]:
        """DHT records this node refused (asked to store them, or found them), by reason."""
        return self.routing.refused_records
