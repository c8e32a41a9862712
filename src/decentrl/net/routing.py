"""Finding and reaching peers: this node's own records in the DHT and every live record under a
key, and the route records (net/reach.py) by which it connects to a peer its daemon cannot dial,
directly or through a relay (net/circuits.py)."""

from __future__ import annotations

import logging
import time
from collections import Counter

from hivemind.utils.timed_storage import get_dht_time

from decentrl.net.circuits import Circuit, Circuits
from decentrl.net.daemon import Daemon
from decentrl.net.dht_storage import BoundedDHTStorage
from decentrl.net.reach import RouteRecord, check_route_record, route_key, through_relay
from decentrl.net.records import MAX_RECORD_BYTES, SignedRecordValidator
from decentrl.net.route_screen import RouteScreen, connected_hosts
from decentrl.net.wire import WireError, decode_struct, encode_struct

log = logging.getLogger(__name__)

# After every route of a peer failed, how long before they are tried again.
ROUTES_RETRY_S = 5.0
# Peers whose routes all failed lately that are remembered: identities are free.
FAILED_ROUTES_KEPT = 1024


class Routing:
    """The DHT records and routes of the node whose daemon is `daemon`."""

    def __init__(self, daemon: Daemon, circuits: Circuits, record_validator: SignedRecordValidator,
                 dht_storage: BoundedDHTStorage, route_screen: RouteScreen) -> None:
        self.daemon = daemon
        self.circuits = circuits
        self.record_validator = record_validator
        self.dht_storage = dht_storage
        self.route_screen = route_screen  # which announced routes may be dialed
        # When each peer's routes last all failed: they are not tried again for a while (a
        # record may list addresses where nobody answers).
        self._failed: dict[str, float] = {}

    # ---- the DHT -------------------------------------------------------------------------

    async def announce(self, key: str, value: bytes, ttl_s: float) -> bool:
        """Store `value` under `key` as this node's record (its subkey is this node's peer id,
        the only one its validator signs), replacing its earlier one; live for `ttl_s` (at most
        `dht_storage.max_ttl_s`). True if the replica that answered last kept it
        (hivemind's answer): a node that has joined no run, or another run, keeps none."""
        assert self.daemon.dht is not None
        self.dht_storage.check_ttl(key, ttl_s)
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"{self.daemon.name}: a record of {len(value)} bytes under {key!r} "
                             f"is over the DHT's limit of {MAX_RECORD_BYTES}")
        return await self.daemon.dht.store(key, value, get_dht_time() + ttl_s,
                                           subkey=self.daemon.identity.peer_id)

    async def lookup(self, key: str) -> dict[str, bytes]:
        """Every live record under `key`: {writer's peer id: value}. Each was validated (signed
        by the writer its subkey names, within the size limit) by this node's validator, when
        it was stored here or when another node returned it."""
        assert self.daemon.dht is not None
        found = await self.daemon.dht.get(key, latest=True)
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

    # ---- routes --------------------------------------------------------------------------

    async def announce_routes(self, record: RouteRecord, ttl_s: float) -> bool:
        """Tell the swarm how to dial this node (net/reach.py)."""
        check_route_record(record)
        return await self.announce(route_key(self.daemon.identity.peer_id),
                                   encode_struct(record), ttl_s)

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
            log.info("%s: the route record of %s is refused: %s", self.daemon.name, peer[-8:],
                     error)
            return None
        return record

    async def connect(self, peer: str) -> bool:
        """Connect to `peer` through the first route of its record that works and that cannot
        aim this node at a third host (net/route_screen.py); False if none did (or it announces
        none)."""
        if time.monotonic() - self._failed.get(peer, -ROUTES_RETRY_S) < ROUTES_RETRY_S:
            return False
        record = await self.routes_of(peer)
        routes: list[str] = []
        if record is not None:
            routes = self.route_screen.usable(peer, record,
                                              await connected_hosts(self.daemon.running))
        for address in routes:
            if not await self.daemon.dial(peer, address):
                continue
            if through_relay(address):
                self.circuits.opened(peer, address)
            else:
                self.circuits.forget(peer)
            self._failed.pop(peer, None)
            log.info("%s: connected to %s through %s", self.daemon.name, peer[-8:], address)
            return True
        self._failed[peer] = time.monotonic()
        while len(self._failed) > FAILED_ROUTES_KEPT:  # identities are free: bounded
            self._failed.pop(next(iter(self._failed)))
        return False

    async def renew_circuit(self, peer: str, circuit: Circuit) -> None:
        """Close the relayed connection to `peer` and dial a fresh one (its routes)."""
        await self.daemon.disconnect(peer)
        self._failed.pop(peer, None)  # the relay answered a moment ago
        if not await self.connect(peer):
            self.circuits.forget(peer)
            raise ConnectionError(f"no fresh relayed connection to {peer[-8:]} (was through "
                                  f"{circuit.address})")
        if not circuit.broken:
            self.circuits.renewals += 1
