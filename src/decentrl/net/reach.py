"""How a peer is reached from elsewhere: its network options (where it listens, what it
announces, which relays it uses), the p2pd flags they become, and the route record it announces.

Three ways to sit on the network:
- loopback: every peer on this machine (the demo and tests). No relays, no NAT traversal, the
  only peers are the ones named. The default.
- direct: a host others can dial (a server, or a home host with a forwarded port). Relays on: it
  can dial peers through relays and, with `relay_service`, relay for others.
- relayed: a host behind NAT. It dials out as usual, takes a slot at each of its relays (circuit
  relay v2) and is dialed through them; its DHT node is a client (others cannot dial it to ask).
- auto: not known yet. A short-lived node that asks a peer to dial it back (net/dialback.py),
  then gives way to a direct or a relayed one.

libp2p advertises relayed addresses only for relays with public IP addresses, and starts hole
punching only once a host has one; a swarm on private addresses (the namespaces of net/netns.py,
a LAN, a VPN) gets neither from the daemon. So every peer announces its own routes instead: a
`RouteRecord` under `route_key(peer id)`, signed (only the peer writes it), with its direct
addresses, or its relays' addresses with `/p2p-circuit`. A node that cannot dial a peer reads
that record and connects through what it lists (net/routing.py `Routing.connect`)."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import base58
import msgspec
import varint
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.protocols import protocol_with_name

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ANY_INTERFACE = "/ip4/0.0.0.0/tcp/0"
Reachability = Literal["loopback", "auto", "direct", "relayed"]
REACHABILITIES: tuple[Reachability, ...] = ("loopback", "auto", "direct", "relayed")
MAX_ROUTES = 8
MAX_ADDRESS_CHARS = 300


def route_key(peer_id: str) -> str:
    return f"decentrl/routes/{peer_id}"


class RouteRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to dial the peer that signed it: full multiaddrs without its own /p2p/ part, direct
    ones (`/ip4/A/tcp/P`) or through a relay (`/ip4/A/tcp/P/p2p/<relay>/p2p-circuit`)."""

    addresses: list[str]
    relayed: bool


def check_route_record(record: RouteRecord) -> None:
    """Raise ValueError naming the first thing wrong with a route record someone announced."""
    if not 0 < len(record.addresses) <= MAX_ROUTES:
        raise ValueError(f"a route record lists 1 to {MAX_ROUTES} addresses, not "
                         f"{len(record.addresses)}")
    for address in record.addresses:
        if len(address) > MAX_ADDRESS_CHARS:
            raise ValueError(f"a route of {len(address)} characters is over {MAX_ADDRESS_CHARS}")
        names = multiaddr_protocols(address)
        if not ip_tcp(names):
            raise ValueError(f"route {address!r} is not an /ip4 or /ip6 TCP address")
        if ("p2p-circuit" in names) != record.relayed:
            raise ValueError(f"route {address!r} does not match relayed={record.relayed}")


def multiaddr_protocols(address: str) -> list[str]:
    try:
        return [protocol.name for protocol in Multiaddr(address).protocols()]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{address!r} is not a multiaddr ({error})") from None


def ip_tcp(protocols: list[str]) -> bool:
    """Whether a multiaddr's protocols are an IP address and a TCP port (and maybe more)."""
    return protocols[:1] in (["ip4"], ["ip6"]) and "tcp" in protocols


def host_of(address: str) -> str:
    """The /ip4/<host> or /ip6/<host> head of a multiaddr ("" for any other)."""
    parts = address.split("/")
    return "/".join(parts[:3]) if len(parts) > 2 and parts[1] in ("ip4", "ip6") else ""


def dialable(address: str) -> Multiaddr:
    """`address` as the daemon reads it. hivemind's multiaddr encodes a /p2p/<id> part as a CID,
    which the daemon refuses ("length greater than remaining number of bytes"); each such part
    is written here as the raw multihash the daemon expects (a relay's id in a circuit
    address)."""
    head, *relays = address.split("/p2p/")
    data = Multiaddr(head).to_bytes() if head else b""
    for part in relays:
        peer, _, rest = part.partition("/")
        digest = base58.b58decode(peer)
        data += protocol_with_name("p2p").vcode + varint.encode(len(digest)) + digest
        if rest:
            data += Multiaddr("/" + rest).to_bytes()
    return Multiaddr(data)


def peer_of(address: str) -> str:
    """The peer id at the end of a full multiaddr."""
    return address.rsplit("/p2p/", 1)[1].split("/")[0]


def through_relay(address: str) -> bool:
    """Whether a multiaddr (a route, or a connection's remote address) goes through a relay."""
    return "/p2p-circuit" in address


def relay_circuit(relay: str) -> str:
    """The circuit address of a relay's full multiaddr (`.../p2p/<relay id>`)."""
    return f"{relay}/p2p-circuit"


@dataclass(frozen=True)
class NetworkOptions:
    """Where a node listens and how others reach it. `announce`: the addresses to give out
    instead of the listen ones (a host's public address where it listens on 0.0.0.0);
    `relays`: full multiaddrs of relays a relayed node takes slots at (by default, its initial
    peers); `relay_service`: a directly reachable node relays for others."""

    listen: tuple[str, ...] = (LOOPBACK,)
    announce: tuple[str, ...] = ()
    relays: tuple[str, ...] = ()
    reachability: Reachability = "loopback"
    relay_service: bool = False
    # The network namespace the daemon runs in (net/netns.py), where this process is not: a
    # test's or demo's in-process coordinator whose daemon sits on the namespaces' public
    # segment. It talks to its daemon over unix sockets, which namespaces do not separate.
    netns: str | None = None

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITIES:
            raise ValueError(f"reachability must be one of {REACHABILITIES}, got "
                             f"{self.reachability!r}")
        if not self.listen:
            raise ValueError("a node needs at least one listen address")
        for address in (*self.listen, *self.announce):
            if not ip_tcp(multiaddr_protocols(address)):
                raise ValueError(f"{address!r}: listen and announce addresses are /ip4/<host>/"
                                 "tcp/<port> (or /ip6/...)")
        for address in self.announce:
            if address.endswith("/tcp/0"):
                raise ValueError(f"announce address {address!r} needs an explicit port")
        for relay in self.relays:
            if "p2p" not in multiaddr_protocols(relay):
                raise ValueError(f"relay {relay!r} lacks its /p2p/<peer id> part")

    def relayed(self, relays: Sequence[str]) -> NetworkOptions:
        """These options, behind NAT through `relays`."""
        return NetworkOptions(self.listen, (), tuple(relays), "relayed", False, self.netns)

    def direct(self) -> NetworkOptions:
        return NetworkOptions(self.listen, self.announce, self.relays, "direct",
                              self.relay_service, self.netns)

    @property
    def dht_client(self) -> bool:
        """Others cannot (or may not yet) dial this node: its DHT node only asks."""
        return self.reachability in ("relayed", "auto")

    def daemon_options(self, initial_peers: Sequence[str]) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
        """(hivemind `P2P.create` keyword arguments, extra p2pd flags) for these options (the
        daemon's placement aside: `netns`)."""
        if self.reachability == "loopback":
            # No NAT port mapping, no AutoNAT, no relays: the only peers are the ones named.
            return {"host_maddrs": list(self.listen), "nat_port_map": False, "auto_nat": False,
                        "use_relay": False, "use_auto_relay": False}, {}
        common = {"host_maddrs": list(self.listen), "nat_port_map": False, "use_relay": True,
                      # AutoNAT also starts libp2p's hole punching, used where it can work.
                      "auto_nat": True}
        if self.reachability == "auto":  # a node that only learns how it can be reached
            return {**common, "dht_mode": "client"}, {"relayService": False}
        if self.reachability == "relayed":
            relays = list(self.relays or initial_peers)
            if not relays:
                raise ValueError("a relayed node needs at least one relay (or initial peer)")
            # Static relays: without relayDiscovery=false the daemon waits minutes for more
            # candidates before it takes a slot.
            return ({**common, "force_reachability": "private", "use_auto_relay": True,
                     "trusted_relays": relays, "dht_mode": "client"},
                    {"relayDiscovery": False, "relayService": False})
        return ({**common, "force_reachability": "public",
                 "announce_maddrs": list(self.announce) or None},
                # The relay keeps libp2p's limits per relayed connection (128 KiB each way, 2
                # min): p2pd applies them whatever it is told (net/circuits.py).
                {"relayService": self.relay_service})


def on_loopback(address: str) -> bool:
    """Whether a multiaddr's host is this machine's loopback."""
    host = host_of(address)
    return bool(host) and ipaddress.ip_address(host.split("/")[2]).is_loopback


def peer_options(initial_peers: Sequence[str], listen: Sequence[str] = (),
                 announce: Sequence[str] = (), relays: Sequence[str] = (),
                 reachability: Reachability | None = None) -> NetworkOptions:
    """A joining peer's options. Unless told otherwise: a swarm on this machine stays on
    loopback; any other is joined as a laptop behind a home router would, listening on every
    interface and checking whether others can dial it (`auto`)."""
    local = all(on_loopback(address) for address in initial_peers)
    chosen = reachability or ("loopback" if local and not listen else "auto")
    default_listen = LOOPBACK if chosen == "loopback" else ANY_INTERFACE
    return NetworkOptions(tuple(listen) or (default_listen,), tuple(announce), tuple(relays),
                          chosen)


def server_options(listen: Sequence[str] = (), announce: Sequence[str] = ()) -> NetworkOptions:
    """A coordinator's or a relay's: on loopback unless it listens elsewhere; then reachable
    directly, relaying for peers behind NAT."""
    if not listen or all(on_loopback(address) for address in listen):
        return NetworkOptions(tuple(listen) or (LOOPBACK,), tuple(announce))
    return NetworkOptions(tuple(listen), tuple(announce), (), "direct", relay_service=True)
