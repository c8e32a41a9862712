"""This process's hivemind p2p daemon and the DHT node that shares it: started under the node's
own key, kept connected to its initial peers from behind NAT, asked what it is connected to, and
stopped; with the emulated links (net/link.py) every call and reply goes through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from decentrl.errors import DecentrlError
from decentrl.net.dht_storage import BoundedDHTStorage, FindReplyBound, NoCache
from decentrl.net.identity import Identity
from decentrl.net.link import LinkEmulator, LinkProfile
from decentrl.net.reach import NetworkOptions, dialable, host_of, peer_of, through_relay
from decentrl.net.records import SignedRecordValidator

log = logging.getLogger(__name__)
LOOPBACK_ONLY = NetworkOptions()
EXAMPLE_ADDRESS = "/ip4/192.0.2.7/tcp/31337/p2p/12D3KooW..."
STARTUP_TIMEOUT_S = 60.0
# How often a node behind NAT checks that it still holds a connection to each of its initial
# peers (the coordinator, its relays) and dials again where not: nobody else can open one to it,
# and the coordinator's large calls cannot take a relay (net/circuits.py).
REDIAL_EVERY_S = 10.0


class SwarmStartError(DecentrlError, RuntimeError):
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


class Daemon:
    """The daemon, DHT node and emulated links of node `name`, once `start`ed (on its loop)."""

    def __init__(self, name: str, identity: Identity, link_profile: LinkProfile) -> None:
        self.name = name
        self.identity = identity
        self.link_profile = link_profile
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None
        self.links: LinkEmulator | None = None
        self.network = LOOPBACK_ONLY

    @property
    def running(self) -> P2P:
        """The started daemon."""
        assert self.p2p is not None, f"{self.name}: the p2p daemon is not started"
        return self.p2p

    async def start(self, initial_peers: list[str], network: NetworkOptions,
                    record_validator: SignedRecordValidator,
                    dht_storage: BoundedDHTStorage) -> None:
        self.network = network
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
                                        record_validator=record_validator,
                                        authorizer=FindReplyBound(dht_storage),
                                        cache_locally=False, cache_nearest=0,
                                        cache_on_store=False)
        self.dht.protocol.storage = dht_storage
        self.dht.protocol.cache = NoCache(dht_storage)
        self.use_link_profile(self.link_profile)
        if network.reachability == "relayed" and initial_peers:
            asyncio.ensure_future(self._keep_connected(initial_peers))  # cancelled at shutdown

    def use_link_profile(self, link_profile: LinkProfile) -> None:
        """Emulate `link_profile` on every link from now on (fresh links, fresh counts)."""
        self.link_profile = link_profile
        self.links = LinkEmulator(local=str(self.running.peer_id), profile=link_profile)

    async def _keep_connected(self, addresses: list[str]) -> None:
        wanted = {peer_of(address): address for address in addresses}
        while True:
            await asyncio.sleep(REDIAL_EVERY_S)
            try:
                connected = {str(info.peer_id) for info in await self.running.list_peers()}
            except P2PDaemonError as error:
                log.info("%s: could not list its connections: %s", self.name, error)
                continue
            for peer, address in wanted.items():
                if peer not in connected and await self.dial(peer, address):
                    log.info("%s: connected again to %s", self.name, address)

    async def dial(self, peer: str, address: str) -> bool:
        """Connect to `peer` at `address` (a full or relayed multiaddr); False, logged, if not."""
        try:
            await self.running._client.connect(PeerID.from_base58(peer), [dialable(address)])
        except (P2PDaemonError, ConnectionError, OSError, ValueError) as error:
            log.info("%s: no connection to %s through %s: %s", self.name, peer[-8:], address,
                     error)
            return False
        return True

    async def disconnect(self, peer: str) -> None:
        """Close the daemon's connections to `peer`, if it can."""
        with contextlib.suppress(P2PDaemonError, ConnectionError, OSError):
            await self.running._client.disconnect(PeerID.from_base58(peer))

    async def connections(self, peer: str) -> tuple[bool, bool]:
        """Whether the daemon holds a connection to `peer` that does not go through a relay (the
        peer dialed this node since, or the connection was upgraded), and one that does."""
        try:
            connections = await self.running.list_peers()
        except P2PDaemonError:
            return False, False
        addresses = [str(address) for info in connections if str(info.peer_id) == peer
                     for address in info.addrs]
        return (any(not through_relay(a) for a in addresses),
                any(through_relay(a) for a in addresses))

    async def peer_hosts(self) -> dict[str, str]:
        """Each connected peer's host as the daemon observed the connection, not as the peer
        claims it: a direct connection's, else its relay's."""
        try:
            connections = await self.running.list_peers()
        except P2PDaemonError:
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
        p2p = self.running
        return [maddr["unix"] for maddr in (p2p._daemon_listen_maddr, p2p._client_listen_maddr)
                if maddr is not None]

    async def stop(self) -> None:
        """Stop the DHT node and the daemon, each within a few seconds: peers that already went
        away must not hold up this process's exit."""
        if self.dht is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.dht.shutdown(), 5)
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.p2p.shutdown(), 5)
