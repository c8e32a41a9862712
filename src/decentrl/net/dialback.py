"""Can others dial this peer? A joining peer asks one already in the swarm (its bootstrap peer,
which serves `dial_back`) to open a fresh connection to it, from a separate probe daemon that
shares no connection with it: directly, at the address the request came from, and through each
of the relays it holds a slot at. The answer says, in plain words, how the peer can be reached
(`Reachable.describe`); `start_reachable` starts a node that way (net/reach.py) and announces
its routes.

Who may ask: anyone (a stranger has to learn whether it can serve). What it can make the checker
do: dial the IP address its own request came from, on at most `MAX_PORTS` ports, and at most
`MAX_RELAYS` relays that are connected to the checker already, at the addresses of those
connections; each dial must authenticate as the asker's peer id. So a stranger cannot aim the
probe at a third host. One check per asker every `CHECK_EVERY_S` (more is refused, no strike),
one at a time per checker."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, Reply, Request, SwarmNode, daemon_class
from decentrl.net.protocol import DIAL_BACK, DialBackReply, DialBackRequest
from decentrl.net.reach import (
    LOOPBACK,
    NetworkOptions,
    RouteRecord,
    dialable,
    host_of,
    multiaddr_protocols,
    relay_circuit,
)
from decentrl.net.wire import WireError

log = logging.getLogger(__name__)

MAX_PORTS = 4
MAX_RELAYS = 4
CHECK_EVERY_S = 5.0
DIAL_TIMEOUT_S = 8.0
ROUTE_TTL_S = 60.0
ASKERS_KEPT = 1024
StartNode = Callable[[NetworkOptions], SwarmNode]


class CheckRefused(RuntimeError):
    """A well-formed check this node will not run now (the asker asked too recently): no
    strike."""


class DialBackService:
    """Serves `dial_back` on a directly reachable node; its probe daemon starts with it (so its
    sockets are known from the start, `socket_paths`) and stops with `close()`."""

    def __init__(self, node: SwarmNode) -> None:
        self.node = node
        self.checks = 0
        self._last: dict[str, float] = {}
        self._busy = asyncio.Lock()
        # A second daemon on this host, connected to nobody: a connection it makes is a fresh
        # dial. Relays on, to dial through them.
        self.probe: P2P = node.run(daemon_class({}, node.network.netns).create(
            host_maddrs=[_probe_listen(node.network)], use_ipfs=False, nat_port_map=False,
            auto_nat=False, use_relay=True, use_auto_relay=False, dht_mode="client",
            conn_manager=False), timeout=60)
        node.serve(DIAL_BACK, self._dial_back)

    def socket_paths(self) -> list[str]:
        """The probe daemon's unix sockets (a killed process leaves them behind)."""
        return [maddr["unix"] for maddr in (self.probe._daemon_listen_maddr,
                                            self.probe._client_listen_maddr)]

    async def _dial_back(self, request: Request[DialBackRequest]) -> Reply:
        body, sender = request.body, request.sender
        if len(body.ports) > MAX_PORTS or not all(0 < p < 65536 for p in body.ports):
            raise ValueError(f"dial_back takes at most {MAX_PORTS} TCP ports in 1-65535")
        if len(body.relays) > MAX_RELAYS:
            raise ValueError(f"dial_back takes at most {MAX_RELAYS} relays")
        now = time.monotonic()
        if now - self._last.get(sender, -CHECK_EVERY_S) < CHECK_EVERY_S:
            raise CheckRefused(f"one check every {CHECK_EVERY_S:.0f}s")
        self._last[sender] = now
        if len(self._last) > ASKERS_KEPT:
            self._last = {p: t for p, t in self._last.items() if now - t < CHECK_EVERY_S}
        targets, errors = await self._targets(body, request.address)
        async with self._busy:
            self.checks += 1
            direct, relayed = "", []
            for address in targets:
                error = await _dial(self.probe, sender, address)
                if error is not None:
                    errors.append(f"{address}: {error}")
                elif "p2p-circuit" in address:
                    relayed.append(address)
                elif not direct:
                    direct = address
        return Reply(DialBackReply(direct=direct, relayed=relayed, errors=errors))

    async def _targets(self, body: DialBackRequest, address: str
                       ) -> tuple[list[str], list[str]]:
        """What to dial: the asker's own IP on its ports, then those of its relays that run on
        the host of a peer connected to this node (or on this node's); and why others were
        left."""
        targets, errors = [], []
        host = host_of(address)
        if host and "p2p-circuit" not in address:
            targets += [f"{host}/tcp/{port}" for port in body.ports]
        elif body.ports:
            errors.append(f"the request came through {address or 'an unknown route'}: no "
                          "direct address to dial back")
        assert self.node.p2p is not None
        # A relay's host: this node's own, or that of a peer connected to it (by either side,
        # so on another port than the one it listens on).
        hosts = {str(info.peer_id): {host_of(str(a)) for a in info.addrs}
                 for info in await self.node.p2p.list_peers()}
        hosts[self.node.peer_id] = {host_of(str(a))
                                    for a in await self.node.p2p.get_visible_maddrs()}
        for relay in body.relays:
            head, _, relay_id = relay.rpartition("/p2p/")
            if "p2p" not in multiaddr_protocols(relay) or not relay_id:
                raise ValueError(f"relay {relay!r} lacks its /p2p/<peer id> part")
            if host_of(head) in hosts.get(relay_id, ()):
                targets.append(relay_circuit(relay))
            else:
                errors.append(f"{relay}: not a peer connected to this one from that host")
        return targets, errors

    async def close(self) -> None:
        await self.probe.shutdown()


def _probe_listen(network: NetworkOptions) -> str:
    """The probe listens where the node does, on another port (it must dial from this host's
    outside address, not from loopback)."""
    head = network.listen[0].rsplit("/tcp/", 1)[0]
    return f"{head}/tcp/0" if network.reachability != "loopback" else LOOPBACK


async def _dial(probe: P2P, peer: str, address: str) -> str | None:
    """None if a fresh connection to `peer` at `address` authenticated, else why not."""
    peer_id = PeerID.from_base58(peer)
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, [dialable(address)]),
                               DIAL_TIMEOUT_S)
    except TimeoutError:
        return f"no answer within {DIAL_TIMEOUT_S:.0f}s"
    except (P2PDaemonError, ConnectionError, OSError, ValueError) as error:
        return _gist(str(error))
    try:
        await probe._client.disconnect(peer_id)
    except (P2PDaemonError, ConnectionError, OSError):
        pass  # the daemon drops it by itself
    return None


def _gist(text: str) -> str:
    """The daemon's own words for a failed dial: its last (most specific) line."""
    lines = [line.strip(" *") for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "failed"


@dataclass
class Reachable:
    """How a peer can be reached, as a check found it."""

    direct: str = ""
    relayed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return bool(self.direct or self.relayed)

    def route(self) -> RouteRecord | None:
        if self.direct:
            return RouteRecord(addresses=[self.direct], relayed=False)
        if self.relayed:
            return RouteRecord(addresses=list(self.relayed), relayed=True)
        return None

    def describe(self) -> str:
        why = "; ".join(self.errors) or "no dial back was tried"
        if self.direct:
            return f"reachable directly at {self.direct}"
        if self.relayed:
            relays = ", ".join(_relay_words(a) for a in self.relayed)
            return f"reachable through relay {relays} (not directly: {why})"
        return f"not reachable by other peers ({why})"


def _relay_words(circuit: str) -> str:
    head, _, rest = circuit.partition("/p2p/")
    return f"{rest.split('/')[0][-8:]} at {head}"


def check_reachability(node: SwarmNode, checkers: Sequence[str], relays: Sequence[str],
                       timeout_s: float = 60.0) -> Reachable:
    """Ask the first of `checkers` (peer ids) that answers to dial this node back on its
    listening ports and through `relays`; if none does, once more after `CHECK_EVERY_S` (a
    checker answers one check per asker in that time)."""
    ports = sorted({int(a.rsplit("/tcp/", 1)[1].split("/")[0]) for a in node.addresses()
                    if "/tcp/" in a and "p2p-circuit" not in a})[:MAX_PORTS]
    request = DialBackRequest(ports=[] if node.network.reachability == "relayed" else ports,
                              relays=list(relays)[:MAX_RELAYS])
    failures = []
    for attempt in range(2):
        if attempt:
            time.sleep(CHECK_EVERY_S)
        for checker in dict.fromkeys(checkers):
            try:
                reply, _ = node.call_sync(checker, DIAL_BACK, request, timeout=timeout_s)
            except (RemoteError, MessageLost, WireError) as error:
                failures.append(f"{checker[-8:]} did not check: {error}")
                continue
            return Reachable(reply.direct, list(reply.relayed), list(reply.errors))
    return Reachable(errors=failures)


def start_reachable(name: str, initial_peers: Sequence[str], options: NetworkOptions,
                    start: StartNode, settle_s: float = 2.0) -> tuple[SwarmNode, Reachable]:
    """A node started as `options` say (`start(options)` makes one) and announced. "auto"
    first asks one of the initial peers to dial it back, then starts for good as a direct node,
    or behind its relays (the initial peers unless `options.relays`), with the same identity."""
    node = start(options)
    if options.reachability == "loopback":
        return node, Reachable()
    checkers = [peer_of(a) for a in initial_peers]
    relays = list(options.relays or initial_peers)
    if options.reachability == "auto":
        first = check_reachability(node, checkers, [])
        node.shutdown()
        if first.direct:
            node, report = start(options.direct()), first
        else:
            log.info("%s: not reachable directly (%s); joining through relays", name,
                     "; ".join(first.errors))
            node = start(options.relayed(relays))
            time.sleep(settle_s)  # the daemon takes its relay slots as it starts
            # The relays check too: the peer that checked first answers this asker once a while.
            report = check_reachability(node, [*map(peer_of, relays), *checkers], relays)
            report.errors = first.errors + report.errors
    else:
        if options.reachability == "relayed":
            time.sleep(settle_s)
        report = check_reachability(node, checkers,
                                    relays if options.reachability == "relayed" else [])
    route = report.route()
    if route is not None:
        keep_routes_announced(node, route)
    return node, report


def keep_routes_announced(node: SwarmNode, route: RouteRecord) -> None:
    """Announce `route` now and renew it until the node stops."""
    async def renew() -> None:
        while True:
            try:
                await node.announce_routes(route, ROUTE_TTL_S)
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("%s: routes not announced: %s", node.name, error)
            await asyncio.sleep(ROUTE_TTL_S / 3)
    node.run(node.announce_routes(route, ROUTE_TTL_S), timeout=30)
    asyncio.run_coroutine_threadsafe(renew(), node.loop)


def peer_of(address: str) -> str:
    """The peer id at the end of a full multiaddr."""
    return address.rsplit("/p2p/", 1)[1].split("/")[0]
