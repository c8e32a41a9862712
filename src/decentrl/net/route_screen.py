"""Which routes of a peer's `RouteRecord` (net/reach.py) this node dials.

Anyone writes its own route record, with any addresses: dialed as written, a record would make
every node that looks for the peer connect to a third host's ports (the node as a port scanner,
or a flood aimed at someone). So a route is dialed only where it cannot aim elsewhere:
- direct, at a host the peer was seen at: one its connection to this node came from (a request
  it sent, or a connection the daemon holds now);
- through a relay, at a host the relay is known at: a relay this node was configured with or
  started from (its initial peers), or a peer this node holds a direct connection to from that
  host (so the dial goes to a host that already talks to this node).
Every other route is refused and counted (`refused`), and the peer's routes that remain are
tried as before."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from decentrl.net.reach import RouteRecord, host_of, peer_of, through_relay

# Peers whose hosts are remembered, the most recent kept: identities are free, so the table is
# bounded (as a node's strike table is); a peer forgotten is seen again at its next request.
SEEN_PEERS = 1024
# Hosts kept per peer: a peer reaches this node from one or two interfaces; more is churn.
SEEN_HOSTS = 4


class RouteScreen:
    def __init__(self) -> None:
        self.relays: dict[str, set[str]] = {}  # relay peer id -> hosts it was given at
        self._seen: OrderedDict[str, list[str]] = OrderedDict()  # peer -> hosts, newest last
        self.refused = 0  # routes left undialed, over this node's life

    def know_relays(self, addresses: Iterable[str]) -> None:
        """Full multiaddrs (`.../p2p/<id>`) of relays this node was given (its relays, its
        initial peers)."""
        for address in addresses:
            self.relays.setdefault(peer_of(address), set()).add(host_of(address))

    def saw(self, peer: str, address: str) -> None:
        """`peer`'s connection to this node came from `address` (a relayed one names the relay's
        host, not the peer's: not kept)."""
        host = host_of(address)
        if not host or through_relay(address):
            return
        hosts = self._seen.pop(peer, [])
        if host in hosts:
            hosts.remove(host)
        self._seen[peer] = [*hosts, host][-SEEN_HOSTS:]
        while len(self._seen) > SEEN_PEERS:
            self._seen.popitem(last=False)

    def usable(self, peer: str, record: RouteRecord,
               connected: Mapping[str, set[str]]) -> list[str]:
        """The routes of `peer`'s record this node may dial, in the record's order; `connected`:
        the hosts of each peer the daemon holds a direct connection to now."""
        usable = []
        for address in record.addresses:
            if through_relay(address):
                head, _, rest = address.partition("/p2p/")
                relay = rest.split("/")[0]
                known = self.relays.get(relay, set()) | connected.get(relay, set())
            else:
                head = address
                known = set(self._seen.get(peer, ())) | connected.get(peer, set())
            if host_of(head) in known:
                usable.append(address)
            else:
                self.refused += 1
        return usable


async def connected_hosts(p2p: P2P) -> dict[str, set[str]]:
    """The hosts of the direct connections the daemon holds, by peer id, this node's own
    addresses under its own id (empty when the daemon does not answer)."""
    try:
        connections = await p2p.list_peers()
        own = await p2p.get_visible_maddrs()
    except P2PDaemonError:
        return {}
    hosts: dict[str, set[str]] = {str(p2p.peer_id): {host_of(str(a)) for a in own}}
    for info in connections:
        hosts.setdefault(str(info.peer_id), set()).update(
            host_of(str(a)) for a in info.addrs if not through_relay(str(a)))
    return hosts
