"""One process's presence on the swarm: a hivemind P2P daemon, a DHT node sharing it, and a typed
RPC layer on top, all on an asyncio loop in a background thread so that synchronous code (the
generation loop, the trainer driver) can call peers while the loop keeps serving them.

Every RPC is a stream in hivemind's protobuf framing, read by our own bounded reader
(net/streams.py): requests and replies are `ExpertRequest`/`ExpertResponse` messages whose
metadata is a msgspec struct and whose tensors go through hivemind's codecs (net/wire.py),
chunked under the 4 MiB message cap. The request id travels in the `uid` field; a server
remembers its last replies by sender and id, so a caller that retries after a lost reply gets the
same answer instead of running the request twice. Every hop goes through the link emulator
(net/link.py) on the caller's side, and every call has a timeout: nothing waits forever on a
peer.

Nothing a peer sends is read past a bound. A request's and a reply's bytes are capped per RPC
(net/protocol.py: a number, or a function of the run's sizes, `SwarmNode.sizes`), and a message
header that declares more is refused before any of the message is read. On the serving side a
stream that sends nothing for `read_timeout_s` is cut, and one sender may have at most
`max_streams_per_sender` requests open at once (past it they are refused, no strike: an honest
caller with many sessions can get there; past twice it, the sender is flooding: a strike, and
the stream is cut unanswered). All senders together hold at most `inflight` bytes of requests
(net/inflight_budget.py): a message past it is refused as busy, before it is read, no strike.
Before any of a request is read, its sender must not be blocked and must pass the caller policy
(`SwarmNode.authorize`). What the node keeps for the DHT is bounded by net/dht_storage.py.

The node's Ed25519 key (net/identity.py) is its daemon's libp2p identity. Every request and
every reply is signed by its sender (`Envelope.signature`, over `message_digest`) and checked
against the authenticated remote peer id before its tensors are decoded or its handler runs; the
signature vouches for the message itself, also where someone relays it later. A sender whose
requests are refused as malformed (a WireError, a bad signature, a handler's ValueError) collects
strikes; `strikes_to_block` of them within `strike_window_s` block it for `block_s`, during
which its requests are refused unread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from decentrl.net.circuits import CIRCUIT_BYTES, REPLY_ROOM, Circuit, Circuits, CircuitTooSmall
from decentrl.net.compute import ComputeThread, Priority
from decentrl.net.dht_storage import BoundedDHTStorage, FindReplyBound, NoCache
from decentrl.net.identity import Identity, verify
from decentrl.net.inflight_budget import InflightBudget
from decentrl.net.link import LinkEmulator, LinkProfile, MessageLost
from decentrl.net.protocol import Rpc, RunSizes, size_limit
from decentrl.net.reach import (
    NetworkOptions,
    RouteRecord,
    check_route_record,
    dialable,
    host_of,
    peer_of,
    route_key,
    through_relay,
)
from decentrl.net.records import MAX_RECORD_BYTES, SignedRecordValidator
from decentrl.net.route_screen import RouteScreen, connected_hosts
from decentrl.net.streams import ErrorFrame, FrameReader, StreamStalled, write_frame
from decentrl.net.text import peer_text
from decentrl.net.wire import (
    MAX_MESSAGE_BYTES,
    ActivationCodec,
    TensorLimits,
    TensorManifest,
    WireError,
    decode_struct,
    decode_tensors,
    encode_struct,
    encode_tensors,
    from_messages,
    message_bytes,
    to_messages,
)

log = logging.getLogger(__name__)
LOOPBACK_ONLY = NetworkOptions()
# hivemind logs every request a handler refuses as a warning with its traceback; the node logs
# refusals itself (one line, with the sender), and a flood of malformed requests would otherwise
# bury everything else.
logging.getLogger("hivemind.p2p.p2p_daemon").setLevel(logging.ERROR)

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")
EXAMPLE_ADDRESS = "/ip4/192.0.2.7/tcp/31337/p2p/12D3KooW..."
# Replies kept for retried requests; activations are a few MiB, so a short memory.
REPLY_CACHE_SIZE = 16
STARTUP_TIMEOUT_S = 60.0
TRUNCATED_REPLY_RETRIES = 3
STRIKES_TO_BLOCK = 20
STRIKE_WINDOW_S = 60.0
BLOCK_S = 300.0
# Senders with recent strikes, and blocked senders, that are remembered. A stream of throwaway
# identities must not grow either table without end, and identities are free, so a cap costs no
# protection: past it, strikes are forgotten stalest first (their sender starts over, as a fresh
# identity would) and blocks soonest to end first. An honest swarm has tens of peers. (Ended
# blocks also go when their sender is looked up.)
STRIKE_TABLE_SIZE = 1024
BLOCK_TABLE_SIZE = 1024
SIGNATURE_DOMAIN = b"decentrl/1"
# After every route of a peer failed, how long before they are tried again.
ROUTES_RETRY_S = 5.0
# How often a node behind NAT checks that it still holds a connection to each of its initial
# peers (the coordinator, its relays) and dials again where not: nobody else can open one to it,
# and the coordinator's large calls cannot take a relay (net/circuits.py).
REDIAL_EVERY_S = 10.0
# Off loopback, the longest a stream may take to open before the peer's routes are tried.
OPEN_TIMEOUT_S = 3.0
# The longest a request stream may send nothing (before or inside its request), or leave a piece
# of its reply unread, before it is cut.
READ_TIMEOUT_S = 10.0
# Requests one sender may have open at a node at once, those waiting for the compute thread
# included.
MAX_STREAMS_PER_SENDER = 32
MessageKind = Literal["request", "reply"]
_KIND_BYTE: dict[MessageKind, bytes] = {"request": b"\x00", "reply": b"\x01"}


class SwarmStartError(RuntimeError):
    """The p2p daemon did not start, or none of the initial peers answered it."""


def check_peer_addresses(addresses: Sequence[str]) -> None:
    """Raise ValueError naming the first address that is not a peer's full multiaddr
    (`/ip4/<host>/tcp/<port>/p2p/<peer id>`): the daemon would fail on it with a Go error."""
    for address in addresses:
        try:
            protocols = [protocol.name for protocol in Multiaddr(address).protocols()]
        except ValueError as error:
            raise ValueError(f"peer address {address!r} is not a multiaddr ({error}); use the "
                             f"address the peer printed, like {EXAMPLE_ADDRESS}") from None
        if "p2p" not in protocols:
            raise ValueError(f"peer address {address!r} lacks its /p2p/<peer id> part; use the "
                             f"address the peer printed, like {EXAMPLE_ADDRESS}")


async def start_daemon(flags: Mapping[str, Any], netns: str | None = None,
                       **options: Any) -> P2P:
    """hivemind's `P2P.create(**options)`, also passing p2pd flags that it does not take, and
    starting the daemon inside network namespace `netns` if one is given. A daemon that exits
    while it starts leaves its control socket behind (p2pd listens on it before it dials the
    initial peers, and exits without removing it when none answers; hivemind removes it only
    for a daemon it stops itself): that socket is removed here."""
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    control_sockets: list[str] = []

    class Daemon(P2P):
        def _make_process_args(self, *args: Any, **kwargs: Any) -> list[str]:
            control_sockets.append(kwargs["listen"]["unix"])
            return [*prefix, *P2P._make_process_args(*args, **kwargs, **flags)]

    try:
        return await Daemon.create(**options)
    except BaseException:
        for path in control_sockets:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise


class RemoteError(RuntimeError):
    """A peer answered with an error, or did not answer in time, or could not be reached."""


class PeerRefused(RemoteError):
    """The peer is alive and answered, with an error: it refused this request."""


class CallerRefused(ValueError):
    """A request its sender may not make (the RPC's callers rule, net/authority.py): refused
    before it is read, and a strike."""


class CallerUnknown(RuntimeError):
    """A request from a sender the callers rule does not know yet (a peer that just joined its
    stage): refused before it is read, not a strike."""


async def only_any_peer(sender: str, rpc: Rpc[Any, Any]) -> None:
    """A node's callers policy until it serves a run: RPCs for "any peer" only."""
    if rpc.callers != "any peer":
        raise CallerRefused(f"{rpc.method} is refused: this node serves no run")


class ReplyContentError(WireError):
    """A reply its sender signed whose content breaks the protocol (non-finite values, tensors
    over the limits or that its RPC never replies with, a body that does not decode): the
    sender's own doing, not the transport's, so proof against it."""


class SenderBlocked(RuntimeError):
    """A request refused unread: its sender sent too many malformed ones lately. Not a strike."""


class TooManyStreams(RuntimeError):
    """A request refused unread: its sender has too many requests open at this node already."""


class CallerLeft(Exception):
    """The caller closed its stream before its answer was ready."""


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every message's metadata: the method's own struct (msgpack bytes), the tensor manifest,
    and the sender's Ed25519 signature of `message_digest`."""

    body: bytes
    manifest: TensorManifest
    signature: bytes


def _length(data: bytes | Sequence[Any]) -> bytes:
    return len(data).to_bytes(8, "little")


def message_digest(kind: MessageKind, method: str, request_id: str, body: bytes,
                   manifest: TensorManifest, parts: Sequence[runtime_pb2.Tensor]) -> bytes:
    """sha256 of everything a message's signature vouches for. Every field is length-prefixed,
    so no two messages share an encoding; the kind, method and request id tie a reply to its
    request. Of each tensor part only the buffer: the manifest fixes its dtype, shape and
    compression (decode_tensors refuses a part that differs from it), and chunking is not part
    of the message."""
    digest = hashlib.sha256(SIGNATURE_DOMAIN + _KIND_BYTE[kind])
    for data in (method.encode(), request_id.encode(), body, encode_struct(manifest)):
        digest.update(_length(data))
        digest.update(data)
    digest.update(_length(parts))
    for part in parts:
        buffer = part.buffer  # a copy per access under protobuf's upb backend: take it once
        digest.update(_length(buffer))
        digest.update(buffer)
    return digest.digest()


def signed_envelope(identity: Identity, kind: MessageKind, method: str, request_id: str,
                    body: bytes, manifest: TensorManifest,
                    parts: Sequence[runtime_pb2.Tensor]) -> bytes:
    """A message's metadata: its Envelope, signed by `identity`, encoded."""
    signature = identity.sign(message_digest(kind, method, request_id, body, manifest, parts))
    return encode_struct(Envelope(body, manifest, signature))


def verify_envelope(sender: str, kind: MessageKind, method: str, request_id: str,
                    envelope: Envelope, parts: Sequence[runtime_pb2.Tensor]) -> None:
    """Raise SignatureError (a WireError) unless `sender` signed this message."""
    digest = message_digest(kind, method, request_id, envelope.body, envelope.manifest, parts)
    verify(sender, digest, envelope.signature)


@dataclass
class Request(Generic[Req]):
    """What a handler receives: the body decoded as its RPC's request, the tensors (checked
    against the RPC's declaration), and who sent them."""

    body: Req
    tensors: dict[str, torch.Tensor]
    sender: str
    address: str = ""  # the multiaddr the sender's stream came from (a relay's, if relayed)


@dataclass
class Reply:
    body: Any = None  # a msgspec struct, encoded by the node
    tensors: Mapping[str, torch.Tensor] | None = None
    codec: ActivationCodec = "fp32"
    # Tensors already encoded (encode_tensors' parts and manifest): a large reply served many
    # times (a stage's weights) is encoded once, not once per request.
    encoded: tuple[list[runtime_pb2.Tensor], TensorManifest] | None = None


Handler = Callable[[Request[Req]], Awaitable[Reply]]


class SwarmNode:
    """Start with `SwarmNode.start(...)`; `shutdown()` stops the daemon and removes its socket."""

    def __init__(self, name: str, link_profile: LinkProfile, limits: TensorLimits,
                 compute_threads: int | None = None, identity: Identity | None = None,
                 strikes_to_block: int = STRIKES_TO_BLOCK,
                 strike_window_s: float = STRIKE_WINDOW_S, block_s: float = BLOCK_S,
                 read_timeout_s: float = READ_TIMEOUT_S,
                 max_streams_per_sender: int = MAX_STREAMS_PER_SENDER) -> None:
        if strikes_to_block < 1 or strike_window_s <= 0 or block_s < 0:
            raise ValueError(f"need strikes_to_block >= 1, strike_window_s > 0, block_s >= 0; got "
                             f"{strikes_to_block}, {strike_window_s}, {block_s}")
        if read_timeout_s <= 0 or max_streams_per_sender < 1:
            raise ValueError(f"need read_timeout_s > 0, max_streams_per_sender >= 1; got "
                             f"{read_timeout_s}, {max_streams_per_sender}")
        self.name = name
        self.limits = limits
        self.link_profile = link_profile
        self.identity = identity or Identity.generate()
        self.strikes_to_block = strikes_to_block
        self.strike_window_s = strike_window_s
        self.block_s = block_s
        self.read_timeout_s = read_timeout_s
        self.max_streams_per_sender = max_streams_per_sender
        # The run's sizes, which bound the activations and micro-batches its RPCs carry: needed to
        # serve those RPCs; a caller without them caps such replies at `limits` alone.
        self.sizes: RunSizes | None = None
        # Who may call what: awaited with (sender, rpc) before any of a request is read; raises
        # CallerRefused (a strike) or CallerUnknown (none) to refuse it (net/authority.py
        # RunAuthority.check). Called on the loop thread.
        self.authorize: Callable[[str, Rpc[Any, Any]], Awaitable[None]] = only_any_peer
        # Called with (peer id, reason) on each strike, from the loop thread.
        self.on_strike: Callable[[str, str], None] | None = None
        # Where strike and block times are read, in monotonic seconds. An attribute, so a test can
        # move a block's end past without waiting for it.
        self.strike_clock: Callable[[], float] = time.monotonic
        # Strike times and blocks per sender: written on the loop, read from any thread.
        self._strike_lock = threading.Lock()
        # Least recently struck first.
        self._strike_times: OrderedDict[str, deque[float]] = OrderedDict()
        self._blocks: dict[str, tuple[float, int]] = {}  # sender -> (until, strikes)
        self._open_streams: dict[str, int] = {}  # sender -> requests open here (loop only)
        # Bytes of requests held at once, all senders together (net/inflight_budget.py).
        self.inflight = InflightBudget()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"p2p-{name}", daemon=True)
        # One compute thread: requests run one at a time, the most urgent first, and the loop
        # stays free to serve the DHT, timeouts and other calls meanwhile.
        # torch's intra-op thread count is per thread under OpenMP: set it where the work runs.
        self.compute_thread = ComputeThread(
            name, (lambda: torch.set_num_threads(compute_threads)) if compute_threads else None)
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.record_validator = SignedRecordValidator(self.identity)
        # What this node keeps for the DHT (net/dht_storage.py): its run's keys only, once it
        # joins one (`dht_storage.join`), within budgets per writer, per key and in total.
        self.dht_storage = BoundedDHTStorage()
        self.links: LinkEmulator | None = None
        # By (sender, request id): a request id is the caller's choice, so another peer that
        # learnt it must not get the caller's reply.
        self._replies: OrderedDict[tuple[str, str],
                                   asyncio.Future[list[runtime_pb2.ExpertResponse]]] = OrderedDict()
        self._closed = False
        self.network = LOOPBACK_ONLY
        # Peers reached through a relay, and what their connections carried (net/circuits.py);
        # when each peer's routes last all failed (they are not tried again for a while: a
        # record may list addresses where nobody answers).
        self.circuits = Circuits()
        self._routes_failed: dict[str, float] = {}
        self.route_screen = RouteScreen()  # which announced routes may be dialed
        self._reached: OrderedDict[str, None] = OrderedDict()  # peers a stream opened to
        # Of what this node sent (requests to peers it reached through a relay, replies to
        # requests that came through one), the bytes that crossed a relay.
        self.relayed_bytes_sent = 0

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
            node.run(node._start(list(initial_peers), network), timeout=STARTUP_TIMEOUT_S)
        except P2PDaemonError as error:
            node.shutdown()
            if "failed to connect to bootstrap peers" in str(error):
                raise SwarmStartError(
                    f"none of the initial peers answered ({', '.join(initial_peers)}): check "
                    "that the peer is running and that the address is the one it printed"
                ) from None
            raise SwarmStartError(f"the p2p daemon did not start: {error}") from None
        except BaseException:
            node.shutdown()
            raise
        return node

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _start(self, initial_peers: list[str], network: NetworkOptions) -> None:
        self.network = network
        self.route_screen.know_relays([*initial_peers, *network.relays])
        options, flags = network.daemon_options(initial_peers)
        # The daemon reads its key from a file at start: a private one in a fresh 0700 folder,
        # gone as soon as the daemon runs.
        key_dir = tempfile.mkdtemp(prefix="decentrl-key-")
        try:
            key_path = os.path.join(key_dir, "identity.key")
            self.identity.write_libp2p_key(key_path)
            # Never the IPFS bootstrap: the only peers are the ones we are told about.
            self.p2p = await start_daemon(
                flags, network.netns,
                initial_peers=initial_peers or None, use_ipfs=False, **options,
                # libp2p's connection manager trims connections past its water marks, which can
                # cut a stream mid-reply; a swarm's peers keep few connections, so keep them all.
                conn_manager=False, startup_timeout=STARTUP_TIMEOUT_S,
                # The check would start a second daemon to dial this id; a key we just made (or
                # were given for this process) is ours alone.
                identity_path=key_path, check_if_identity_free=False)
        finally:
            shutil.rmtree(key_dir, ignore_errors=True)
        if str(self.p2p.peer_id) != self.identity.peer_id:
            raise RuntimeError(f"{self.name}: the p2p daemon runs as {self.p2p.peer_id}, not as "
                               f"its identity {self.identity.peer_id}; its signatures would not "
                               f"verify")
        # A relayed node's DHT is a client: nobody can dial it to ask (or store) anything.
        self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=initial_peers or None,
                                        ensure_bootstrap_success=bool(initial_peers),
                                        client_mode=network.dht_client,
                                        record_validator=self.record_validator,
                                        authorizer=FindReplyBound(self.dht_storage),
                                        cache_locally=False, cache_nearest=0,
                                        cache_on_store=False)
        self.dht.protocol.storage = self.dht_storage
        self.dht.protocol.cache = NoCache(self.dht_storage)
        self.links = LinkEmulator(local=str(self.p2p.peer_id), profile=self.link_profile)
        if network.reachability == "relayed" and initial_peers:
            asyncio.ensure_future(self._keep_connected(initial_peers))  # cancelled at shutdown

    async def _keep_connected(self, addresses: list[str]) -> None:
        assert self.p2p is not None
        wanted = {peer_of(address): address for address in addresses}
        while True:
            await asyncio.sleep(REDIAL_EVERY_S)
            try:
                connected = {str(info.peer_id) for info in await self.p2p.list_peers()}
            except P2PDaemonError as error:
                log.info("%s: could not list its connections: %s", self.name, error)
                continue
            for peer, address in wanted.items():
                if peer not in connected and await self._dial(peer, address):
                    log.info("%s: connected again to %s", self.name, address)

    async def _dial(self, peer: str, address: str) -> bool:
        """Connect to `peer` at `address` (a full or relayed multiaddr); False, logged, if not."""
        assert self.p2p is not None
        try:
            await self.p2p._client.connect(PeerID.from_base58(peer), [dialable(address)])
        except (P2PDaemonError, ConnectionError, OSError, ValueError) as error:
            log.info("%s: no connection to %s through %s: %s", self.name, peer[-8:], address,
                     error)
            return False
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_id(self) -> str:
        assert self.p2p is not None
        return str(self.p2p.peer_id)

    def addresses(self) -> list[str]:
        assert self.p2p is not None
        return [str(a) for a in self.run(self.p2p.get_visible_maddrs(), timeout=30)]

    def peer_hosts(self) -> dict[str, str]:
        """Each connected peer's host as this node's daemon observed the connection, not as the
        peer claims it: a direct connection's, else its relay's (net/probation.py)."""
        assert self.p2p is not None
        try:
            connections = self.run(self.p2p.list_peers(), timeout=10)
        except (P2PDaemonError, TimeoutError):
            return {}
        hosts = {}
        for info in connections:
            addresses = sorted(map(str, info.addrs), key=through_relay)  # direct first
            host = next((host_of(a) for a in addresses if host_of(a)), None)
            if host is not None:
                hosts[str(info.peer_id)] = host
        return hosts

    def socket_paths(self) -> list[str]:
        """The daemon's unix sockets (removed on shutdown; a killed process leaves them)."""
        assert self.p2p is not None
        paths = []
        for maddr in (self.p2p._daemon_listen_maddr, self.p2p._client_listen_maddr):
            if maddr is not None:
                paths.append(maddr["unix"])
        return paths

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            async def stop() -> None:
                # Bounded: peers that already went away must not hold up our own exit.
                if self.dht is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.dht.shutdown(), 5)
                if self.p2p is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.p2p.shutdown(), 5)
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
        assert self.p2p is not None
        self.link_profile = link_profile
        self.links = LinkEmulator(local=str(self.p2p.peer_id), profile=link_profile)
        if compute_threads:
            self.compute_thread.submit(Priority.TRAINING, torch.set_num_threads,
                                       compute_threads).result(timeout=30)

    async def compute(self, fn: Callable[..., T], *args: Any, priority: Priority) -> T:
        """Run blocking work (a forward pass) on the compute thread, after any more urgent work
        that waits (net/compute.py)."""
        return await asyncio.wrap_future(self.compute_thread.submit(priority, fn, *args),
                                         loop=self.loop)

    # ---- serving ---------------------------------------------------------------------------

    def serve(self, rpc: Rpc[Req, Any], handler: Handler[Req]) -> None:
        """Serve `rpc` (net/protocol.py) with `handler`. A request is refused before any of it is
        read if its sender has too many requests open here, is blocked, or may not call `rpc`
        (`authorize`); it is refused, and counted as a strike, as soon as a message header
        declares more than the RPC's size limit, and unless its body decodes as the RPC's request
        and its tensors are the ones the RPC takes; only then does the handler run. A stream that
        sends nothing for `read_timeout_s` is cut."""
        assert self.p2p is not None
        declared = size_limit(rpc.max_bytes, self.sizes)
        if declared is None:
            raise ValueError(f"{rpc.method}'s request limit depends on the run's sizes: set the "
                             f"node's sizes (RunSizes.of(spec, config)) before serving it")
        limit = min(declared, self.limits.max_total_bytes)

        async def handle_stream(info: StreamInfo, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
            sender = str(info.peer_id)
            self.route_screen.saw(sender, str(info.addr))
            stream = FrameReader(reader, f"{rpc.method} request", limit, self.read_timeout_s,
                                 self.inflight)
            with contextlib.closing(writer):
                try:
                    await self._serve_stream(rpc, handler, sender, str(info.addr), stream,
                                             writer)
                finally:
                    stream.release()

        self.run(self.p2p.add_binary_stream_handler(f"decentrl.{rpc.method}", handle_stream),
                 timeout=30)

    def open_streams(self, peer: str) -> int:
        """`peer`'s requests open at this node now (counted on the loop thread)."""
        return self._open_streams.get(peer, 0)

    async def _serve_stream(self, rpc: Rpc[Req, Any], handler: Handler[Req], sender: str,
                            address: str, stream: FrameReader,
                            writer: asyncio.StreamWriter) -> None:
        method = rpc.method
        open_streams = self._open_streams.get(sender, 0) + 1
        self._open_streams[sender] = open_streams
        try:
            if open_streams > 2 * self.max_streams_per_sender:
                self._strike(sender, method, TooManyStreams(
                    f"{open_streams} requests open at once; the stream is cut unanswered"))
                return
            try:
                responses = await self._answer(rpc, handler, sender, address, stream,
                                               open_streams)
            except CallerLeft:
                return
            except StreamStalled as error:
                log.info("%s: %s from %s cut: %s", self.name, method, sender[-8:], error)
                await write_frame(writer, RPCError(message=str(error)), self.read_timeout_s)
                return
            except Exception as error:  # a refusal: the caller gets its text
                await write_frame(writer, RPCError(message=str(error)), self.read_timeout_s)
                await stream.discard_rest(MAX_MESSAGE_BYTES)
                return
            for response in responses:
                await write_frame(writer, response, self.read_timeout_s)
        except (ConnectionError, TimeoutError) as error:  # the caller left, or stopped reading
            log.info("%s: %s from %s: could not answer: %r", self.name, method, sender[-8:],
                     error)
        finally:
            # The count now, not the one this stream saw: others opened and closed meanwhile.
            still_open = self._open_streams.get(sender, 1) - 1
            if still_open > 0:
                self._open_streams[sender] = still_open
            else:
                self._open_streams.pop(sender, None)

    async def _answer(self, rpc: Rpc[Req, Any], handler: Handler[Req], sender: str, address: str,
                      stream: FrameReader, open_streams: int) -> list[runtime_pb2.ExpertResponse]:
        """The reply to the request on `stream`, or the refusal raised (its text goes back)."""
        method = rpc.method
        if open_streams > self.max_streams_per_sender:
            raise TooManyStreams(f"{method}: peer {sender[-8:]} has "
                                 f"{self.max_streams_per_sender} requests open here already")
        try:
            self._refuse_if_blocked(sender)
            await self.authorize(sender, rpc)
            messages = await stream.requests(runtime_pb2.ExpertRequest)
            if messages is None:
                raise CallerLeft
            request_id, envelope, parts = self._open_request(method, messages, sender)
        except ValueError as error:  # WireError, SignatureError and CallerRefused included
            self._strike(sender, method, error)
            raise
        # A retried request (its reply was lost) gets the first reply, not a second run.
        key = (sender, request_id)
        cached = self._replies.get(key) if request_id else None
        if cached is None:
            cached = self.loop.create_future()
            if request_id:
                self._replies[key] = cached
                while len(self._replies) > REPLY_CACHE_SIZE:
                    self._replies.popitem(last=False)
            try:
                cached.set_result(await _unless_caller_leaves(
                    stream, self._handle(rpc, handler, request_id, envelope, parts, sender,
                                         address)))
            except (asyncio.CancelledError, CallerLeft):
                log.warning("%s: %s from %s cancelled mid-request", self.name, method,
                            sender[-8:])
                self._replies.pop(key, None)
                cached.cancel()
                raise
            except Exception as error:
                # A ValueError is the request's fault (bad tensors, a handler's PeerError);
                # anything else (a timeout, a bug) is not held against the sender.
                if isinstance(error, ValueError):
                    self._strike(sender, method, error)
                else:
                    log.info("%s: %s from %s refused: %s", self.name, method, sender[-8:],
                             error)
                self._replies.pop(key, None)
                cached.set_exception(error)
                cached.exception()  # retrieved here; the caller gets it below
        responses = await asyncio.shield(cached)
        assert self.links is not None
        await self.links.uplink.send(message_bytes(responses), sender)
        if through_relay(address):
            self.relayed_bytes_sent += message_bytes(responses)
        self.circuits.seen(sender, address, message_bytes(messages), message_bytes(responses))
        return responses

    def unserve(self, rpc: Rpc[Any, Any]) -> None:
        """Stop serving `rpc`, so that another object on this node may serve it later (a
        restarted coordinator on the same node). A stopped node serves nothing anyway."""
        if self._closed or self.p2p is None:
            return
        try:
            self.run(self.p2p.remove_binary_stream_handler(f"decentrl.{rpc.method}"), timeout=30)
        except (P2PDaemonError, TimeoutError) as error:
            log.warning("%s: could not stop serving %s: %s", self.name, rpc.method, error)

    def _open_request(self, method: str, messages: list[Any], sender: str
                      ) -> tuple[str, Envelope, list[runtime_pb2.Tensor]]:
        """The request id, envelope and tensor parts of a request that `sender` signed. Nothing
        is decoded past the envelope before the signature checks out."""
        request_id, metadata, parts = from_messages(messages)
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(sender, "request", method, request_id, envelope, parts)
        return request_id, envelope, parts

    async def _handle(self, rpc: Rpc[Req, Any], handler: Handler[Req], request_id: str,
                      envelope: Envelope, parts: list[runtime_pb2.Tensor], sender: str,
                      address: str) -> list[runtime_pb2.ExpertResponse]:
        body = decode_struct(envelope.body, rpc.request)
        tensors = decode_tensors(parts, envelope.manifest, self.limits)
        rpc.check_tensors(tensors)
        reply = await handler(Request(body, tensors, sender, address))
        if not isinstance(reply.body, rpc.reply):  # a bug here, not the sender's fault
            raise TypeError(f"the {rpc.method} handler replied with {type(reply.body).__name__}, "
                            f"not {rpc.reply.__name__}")
        if reply.encoded is not None:
            out_parts, manifest = reply.encoded
        else:
            out_parts, manifest = encode_tensors(dict(reply.tensors or {}), reply.codec)
        metadata = signed_envelope(self.identity, "reply", rpc.method, request_id,
                                   encode_struct(reply.body), manifest, out_parts)
        return to_messages(runtime_pb2.ExpertResponse, metadata, out_parts)

    # ---- strikes against senders of malformed requests -----------------------------------

    def strikes(self, peer: str) -> int:
        """`peer`'s strikes within the last `strike_window_s` (0 while it is blocked)."""
        horizon = self.strike_clock() - self.strike_window_s
        with self._strike_lock:
            return sum(t > horizon for t in self._strike_times.get(peer, ()))

    def blocked(self, peer: str) -> bool:
        return self._block_left(peer) is not None

    def _block_left(self, peer: str) -> tuple[float, int] | None:
        """(seconds left, strikes that caused it) of `peer`'s block, or None."""
        now = self.strike_clock()
        with self._strike_lock:
            block = self._blocks.get(peer)
            if block is None:
                return None
            until, strikes = block
            if until <= now:
                del self._blocks[peer]
                return None
            return until - now, strikes

    def _refuse_if_blocked(self, sender: str) -> None:
        block = self._block_left(sender)
        if block is not None:
            left, strikes = block
            raise SenderBlocked(f"peer {sender[-8:]} is blocked for {left:.0f}s after {strikes} "
                                f"malformed requests")

    def _strike(self, sender: str, method: str, error: Exception) -> None:
        """Count a request refused as malformed against its sender; block it at the limit."""
        now = self.strike_clock()
        horizon = now - self.strike_window_s
        with self._strike_lock:
            block = self._blocks.get(sender)
            if block is not None and block[0] > now:
                return  # a request that was in flight when the block began
            self._blocks.pop(sender, None)
            times = self._strike_times.setdefault(sender, deque())
            self._strike_times.move_to_end(sender)
            times.append(now)
            while times[0] <= horizon:
                times.popleft()
            count = len(times)
            if count >= self.strikes_to_block:
                del self._strike_times[sender]
                while len(self._blocks) >= BLOCK_TABLE_SIZE:
                    # The first block in the table ends first (each lasts block_s): ended or
                    # ending soonest, it is the one to forget.
                    del self._blocks[next(iter(self._blocks))]
                self._blocks[sender] = (now + self.block_s, count)
            while len(self._strike_times) > STRIKE_TABLE_SIZE:
                self._strike_times.popitem(last=False)
        # The error's text may be the sender's own (a field name, a session id): made inert.
        log.info("%s: %s from %s refused (strike %d of %d): %s", self.name, method, sender[-8:],
                 count, self.strikes_to_block, peer_text(error))
        if count >= self.strikes_to_block:
            log.warning("%s: blocking %s for %.0fs after %d malformed requests in %.0fs",
                        self.name, sender[-8:], self.block_s, count, self.strike_window_s)
        if self.on_strike is not None:
            try:
                self.on_strike(sender, f"{method}: {error}")
            except Exception:  # a listener's bug must not break serving
                log.exception("%s: on_strike failed", self.name)

    # ---- calling -------------------------------------------------------------------------

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
        assert self.p2p is not None and self.links is not None
        if not isinstance(body, rpc.request):
            raise TypeError(f"{rpc.method} takes a {rpc.request.__name__} body, not "
                            f"{type(body).__name__}")
        method = rpc.method
        parts, manifest = encode_tensors(dict(tensors or {}), codec)
        if exact:
            exact_parts, exact_manifest = encode_tensors(dict(exact), "fp32")
            parts = [*parts, *exact_parts]
            manifest = TensorManifest(tensors=manifest.tensors + exact_manifest.tensors)
        request_id = request_id or secrets.token_hex(8)
        metadata = signed_envelope(self.identity, "request", method, request_id,
                                   encode_struct(body), manifest, parts)
        requests = to_messages(runtime_pb2.ExpertRequest, metadata, parts, uid=request_id)
        declared = size_limit(rpc.max_reply_bytes, self.sizes)
        reply_limit = self.limits.max_total_bytes if declared is None \
            else min(declared, self.limits.max_total_bytes)
        link = self.links.link(peer)
        try:
            async with asyncio.timeout(timeout):
                await self.links.uplink.send(message_bytes(requests), peer)
                await link.send(message_bytes(requests), "out")
                for attempt in range(TRUNCATED_REPLY_RETRIES + 1):
                    responses = await self._exchange(peer, method, requests, reply_limit)
                    try:
                        reply_body, reply_tensors = self._decode_reply(responses, peer, method,
                                                                       request_id)
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
                        log.info("%s: %s at %s: incomplete reply (%s); asking again", self.name,
                                 method, peer[-8:], error)
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
        try:
            rpc.check_reply_tensors(reply_tensors)
            return decode_struct(reply_body, rpc.reply), reply_tensors
        except WireError as error:
            raise ReplyContentError(f"{method} at {peer[-8:]}: {error}") from None

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
            if self.network.reachability == "loopback" \
                    or not await self._connect_by_routes(peer):
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
            # What the daemon holds is asked under the lock: a renewal by another call in
            # between would otherwise be taken for the connection the peer closed, and
            # replaced again under that call.
            async with circuit.changed:
                direct, connected = await self._connections(peer)
                if not direct and request_bytes > CIRCUIT_BYTES:
                    raise CircuitTooSmall(
                        f"{method}: a request of {request_bytes} bytes is more than a relayed "
                        f"connection carries ({CIRCUIT_BYTES}), and {peer[-8:]} is reached "
                        "through a relay")
                while not direct and not circuit.has_room(request_bytes, reply_room) \
                        and circuit.in_flight:
                    await circuit.changed.wait()  # calls in flight end within their timeout
                    direct, connected = await self._connections(peer)
                if not direct:
                    if not connected or not circuit.has_room(request_bytes, reply_room):
                        # Full or old; or closed by the peer (it renews it too, by its own
                        # count): dial the relay now, before the daemon spends seconds dialing
                        # the peer's own addresses, which only its LAN can reach.
                        await self._renew_circuit(peer, circuit)
                    circuit.reserve(request_bytes, reply_room)
            if direct:
                self.circuits.forget(peer)
                return await self._talk(await self._open(peer, method), method, requests,
                                        reply_limit)
            sent = received = 0
            try:
                stream = await self._open(peer, method)
                sent = request_bytes
                self.relayed_bytes_sent += request_bytes
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
                async with circuit.changed:
                    circuit.settle(request_bytes, reply_room, sent, received)
                    circuit.changed.notify_all()

    async def _connections(self, peer: str) -> tuple[bool, bool]:
        """Whether the daemon holds a connection to `peer` that does not go through a relay (the
        peer dialed this node since, or the connection was upgraded), and one that does."""
        assert self.p2p is not None
        try:
            connections = await self.p2p.list_peers()
        except P2PDaemonError:
            return False, False
        addresses = [str(address) for info in connections if str(info.peer_id) == peer
                     for address in info.addrs]
        return (any(not through_relay(a) for a in addresses),
                any(through_relay(a) for a in addresses))

    async def _renew_circuit(self, peer: str, circuit: Circuit) -> None:
        """Close the relayed connection to `peer` and dial a fresh one (its routes)."""
        assert self.p2p is not None
        with contextlib.suppress(P2PDaemonError, ConnectionError, OSError):
            await self.p2p._client.disconnect(PeerID.from_base58(peer))
        self._routes_failed.pop(peer, None)  # the relay answered a moment ago
        if not await self._connect_by_routes(peer):
            self.circuits.forget(peer)
            raise ConnectionError(f"no fresh relayed connection to {peer[-8:]} (was through "
                                  f"{circuit.address})")
        if not circuit.broken:
            self.circuits.renewals += 1

    async def _open(self, peer: str, method: str
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `peer`'s `method`. Off loopback, to a peer never reached before or
        reached through a relay, P2PDaemonError also when the daemon takes over OPEN_TIMEOUT_S:
        it is dialing addresses of the peer's that nobody outside its LAN can reach (a peer
        behind NAT), which fails only after seconds; the peer's routes come next. (Opening a
        stream on a live connection is quick, but may wait for a busy daemon: not timed.)"""
        assert self.p2p is not None
        opening = self.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                      f"decentrl.{method}")
        if self.network.reachability == "loopback" \
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
        while len(self._reached) > STRIKE_TABLE_SIZE:  # identities are free: bounded
            self._reached.popitem(last=False)
        return reader, writer

    async def _talk(self, stream: tuple[asyncio.StreamReader, asyncio.StreamWriter], method: str,
                    requests: list[runtime_pb2.ExpertRequest], reply_limit: int
                    ) -> list[runtime_pb2.ExpertResponse]:
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

    def _decode_reply(self, responses: list[Any], peer: str, method: str, request_id: str
                      ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The body and tensors of `peer`'s reply, checked to be its signed answer to this very
        request before its tensors are decoded."""
        _, metadata, parts = from_messages(responses)
        envelope = decode_struct(metadata, Envelope)
        verify_envelope(peer, "reply", method, request_id, envelope, parts)
        try:
            return envelope.body, decode_tensors(parts, envelope.manifest, self.limits)
        except WireError as error:
            raise ReplyContentError(f"{method} at {peer[-8:]}: {error}") from None

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

    # ---- routes --------------------------------------------------------------------------

    async def announce_routes(self, record: RouteRecord, ttl_s: float) -> bool:
        """Tell the swarm how to dial this node (net/reach.py)."""
        check_route_record(record)
        return await self.announce(route_key(self.peer_id), encode_struct(record), ttl_s)

    async def routes_of(self, peer: str) -> RouteRecord | None:
        """`peer`'s own route record (one that anyone else wrote under its key is ignored), or
        None if it has none or it is malformed."""
        value = (await self.lookup(route_key(peer))).get(peer)
        if value is None:
            return None
        try:
            record = decode_struct(value, RouteRecord)
            check_route_record(record)
        except (WireError, ValueError) as error:
            log.info("%s: the route record of %s is refused: %s", self.name, peer[-8:], error)
            return None
        return record

    async def _connect_by_routes(self, peer: str) -> bool:
        """Connect to `peer` through the first route of its record that works and that cannot
        aim this node at a third host (net/route_screen.py); False if none did (or it announces
        none)."""
        assert self.p2p is not None
        if time.monotonic() - self._routes_failed.get(peer, -ROUTES_RETRY_S) < ROUTES_RETRY_S:
            return False
        record = await self.routes_of(peer)
        routes = self.route_screen.usable(peer, record, await connected_hosts(self.p2p)) \
            if record is not None else []
        for address in routes:
            if not await self._dial(peer, address):
                continue
            if through_relay(address):
                self.circuits.opened(peer, address)
            else:
                self.circuits.forget(peer)
            self._routes_failed.pop(peer, None)
            log.info("%s: connected to %s through %s", self.name, peer[-8:], address)
            return True
        self._routes_failed[peer] = time.monotonic()
        while len(self._routes_failed) > STRIKE_TABLE_SIZE:  # identities are free: bounded
            self._routes_failed.pop(next(iter(self._routes_failed)))
        return False

    # ---- DHT -----------------------------------------------------------------------------

    async def announce(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Store `value` under `key` as this node's record (its subkey is this node's peer id,
        the only one its validator signs), replacing its earlier one; live for `ttl_s` (at most
        `dht_storage.max_ttl_s`). True if the replica that answered last kept it
        (hivemind's answer): a node that has joined no run, or another run, keeps none."""
        assert self.dht is not None
        self.dht_storage.check_ttl(key, ttl_s)
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"{self.name}: a record of {len(value)} bytes under {key!r} is over "
                             f"the DHT's limit of {MAX_RECORD_BYTES}")
        return await self.dht.store(key, value, get_dht_time() + ttl_s, subkey=self.peer_id)

    async def lookup(self, key: str) -> dict[str, bytes]:
        """Every live record under `key`: {writer's peer id: value}. Each was validated (signed
        by the writer its subkey names, within the size limit) by this node's validator, when
        it was stored here or when another node returned it."""
        assert self.dht is not None
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        return {writer: entry.value for writer, entry in found.value.items()
                if entry.expiration_time > now and isinstance(writer, str)
                and isinstance(entry.value, bytes)}

    @property
    def refused_records(self) -> dict[str, int]:
        """DHT records this node refused (asked to store them, or found them), by reason."""
        return dict(Counter(self.record_validator.refused) + Counter(self.dht_storage.refused))


async def _send_requests(writer: asyncio.StreamWriter,
                         requests: list[runtime_pb2.ExpertRequest]) -> None:
    for request in requests:
        await write_frame(writer, request, None)
    await write_frame(writer, P2P.END_OF_STREAM, None)


def _retrieve_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


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
