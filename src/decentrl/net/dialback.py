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
probe at a third host. Each dial takes at most `DIAL_TIMEOUT_S` and a check `CHECK_BUDGET_S`
whatever its targets do (its dials run one after another: the daemon's connect returns at once
for a peer it is connected to, so two at once could not tell which address answered). An asker
has one check pending at a time and asks at most once every `CHECK_EVERY_S`; `PARALLEL_CHECKS`
checks run at once and the others wait in a line served round robin across the askers' hosts
(many keys on one host are one asker: they get one turn per round), bounded per host and in
total (`CheckLine`). A check refused for any of these, or one that waited `LINE_WAIT_S` without
its turn, is "try again later" (`CheckDeferred`, no strike), which the asker reads as exactly
that: it asks its next checker, then all of them again after a pause (`check_reachability`); a
call that times out is read the same way. An asker never takes a checker's crowd for its own
unreachability."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from decentrl.errors import DecentrlError, SenderFault
from decentrl.net.calls import PeerRefused, RemoteError
from decentrl.net.daemon import start_daemon
from decentrl.net.guard import Reply, Request
from decentrl.net.link import MessageLost
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import DIAL_BACK, DialBackReply, DialBackRequest
from decentrl.net.reach import (
    LOOPBACK,
    NetworkOptions,
    RouteRecord,
    dialable,
    host_of,
    multiaddr_protocols,
    peer_of,
    relay_circuit,
    through_relay,
)
from decentrl.net.wire import WireError

log = logging.getLogger(__name__)

MAX_PORTS = 4
MAX_RELAYS = 4
CHECK_EVERY_S = 5.0
# One dial: an answering peer authenticates within a second on any real link. A check's dials,
# one after another, stop at CHECK_BUDGET_S (the targets left are reported as not tried).
DIAL_TIMEOUT_S = 4.0
CHECK_BUDGET_S = 12.0
ROUTE_TTL_S = 60.0
ASKERS_KEPT = 1024
# Checks running at once on the probe daemon (each one dial at a time).
PARALLEL_CHECKS = 4
# Waiting checks: per asker host (many keys on one host are one asker), and in total. The last
# in line has its turn within MAX_WAITING_CHECKS / PARALLEL_CHECKS * CHECK_BUDGET_S = 48 s.
MAX_WAITING_PER_HOST = 4
MAX_WAITING_CHECKS = 16
# A check not started within this is deferred ("try again later"), not run late: with its budget
# it answers within the asker's call timeout (60 s by default), and a call that timed out says
# nothing about the asker's reachability.
LINE_WAIT_S = 40.0
# How long an asker keeps asking while every checker says "try again later".
BUSY_WAIT_S = 300.0
TRY_LATER = "try again later"
StartNode = Callable[[NetworkOptions], SwarmNode]
Clock = Callable[[], float]


class CheckDeferred(DecentrlError, RuntimeError):
    """A well-formed check this node will not run now (the asker asked too recently or has one
    pending, its host's or the checker's line is full, or it waited `LINE_WAIT_S` in line): no
    strike. Its text ends in TRY_LATER, which the asker reads back from the refusal."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; {TRY_LATER}")


class CheckersBusy(DecentrlError, RuntimeError):
    """Every checker asked said "try again later" for as long as the asker would wait: whether
    this peer can be reached is unknown (not "unreachable")."""


class CheckLine:
    """Whose check runs next: `parallel` at once, the others waiting their turn round robin
    across the askers' hosts, at most `per_host` waiting from one host and `total` in all. Used
    on the event loop's thread only."""

    def __init__(self, parallel: int, per_host: int, total: int) -> None:
        self.parallel, self.per_host, self.total = parallel, per_host, total
        self.running = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(line) for line in self._waiting.values())

    async def turn(self, host: str, wait_s: float) -> None:
        """Once a check from `host` may run (the caller then calls `done()` when it ends);
        CheckDeferred when the line is full or the turn did not come within `wait_s`."""
        if self.running < self.parallel and not self._waiting:
            self.running += 1
            return
        line = self._waiting.get(host, deque())
        if len(line) >= self.per_host:
            raise CheckDeferred(f"{len(line)} checks from {host or 'that host'} are waiting")
        if self.waiting >= self.total:
            raise CheckDeferred(f"busy with {self.running} checks and {self.waiting} waiting")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[host] = line
        line.append(turn)
        try:
            await asyncio.wait_for(turn, wait_s)
        except BaseException as error:  # deferred, or the asker left
            if turn.done() and not turn.cancelled():
                self.done()  # given its turn as it left: the turn goes on
            else:
                self._leave(host, turn)
            if isinstance(error, TimeoutError):
                raise CheckDeferred(f"its turn did not come within {wait_s:.0f}s") from None
            raise

    def done(self) -> None:
        """A check ended: the first waiting check of the next host in turn runs."""
        self.running -= 1
        while self._waiting and self.running < self.parallel:
            host, line = next(iter(self._waiting.items()))
            turn = line.popleft()
            if line:
                self._waiting.move_to_end(host)  # its next check waits for every other host
            else:
                del self._waiting[host]
            if not turn.done():
                turn.set_result(None)
                self.running += 1

    def _leave(self, host: str, turn: asyncio.Future[None]) -> None:
        line = self._waiting.get(host)
        if line is not None and turn in line:
            line.remove(turn)
            if not line:
                del self._waiting[host]


class DialBackService:
    """Serves `dial_back` on a directly reachable node; its probe daemon starts with it (so its
    sockets are known from the start, `socket_paths`) and stops with `close()`. `clock` paces
    each asker's checks (injected by tests)."""

    def __init__(self, node: SwarmNode, clock: Clock = time.monotonic) -> None:
        self.node, self.clock = node, clock
        self.checks = 0  # run to the end
        self.deferred = 0  # answered "try again later"
        self._last: dict[str, float] = {}
        self._asking: set[str] = set()  # askers with a check waiting or running (one each)
        self.line = CheckLine(PARALLEL_CHECKS, MAX_WAITING_PER_HOST, MAX_WAITING_CHECKS)
        # A second daemon on this host, connected to nobody: a connection it makes is a fresh
        # dial. Relays on, to dial through them.
        self.probe: P2P = node.run(start_daemon(
            {}, node.network.netns,
            host_maddrs=[_probe_listen(node.network)], use_ipfs=False, nat_port_map=False,
            auto_nat=False, use_relay=True, use_auto_relay=False, dht_mode="client",
            conn_manager=False), timeout=60)
        node.serve(DIAL_BACK, self._dial_back)

    @property
    def pending(self) -> int:
        """Checks running or waiting."""
        return len(self._asking)

    def socket_paths(self) -> list[str]:
        """The probe daemon's unix sockets (a killed process leaves them behind)."""
        return [maddr["unix"] for maddr in (self.probe._daemon_listen_maddr,
                                            self.probe._client_listen_maddr)]

    async def _dial_back(self, request: Request[DialBackRequest]) -> Reply:
        body, sender = request.body, request.sender
        if len(body.ports) > MAX_PORTS or not all(0 < p < 65536 for p in body.ports):
            raise SenderFault(f"dial_back takes at most {MAX_PORTS} TCP ports in 1-65535")
        if len(body.relays) > MAX_RELAYS:
            raise SenderFault(f"dial_back takes at most {MAX_RELAYS} relays")
        try:
            return await self._check(body, sender, request.address)
        except CheckDeferred:
            self.deferred += 1
            raise

    async def _check(self, body: DialBackRequest, sender: str, address: str) -> Reply:
        if sender in self._asking:
            raise CheckDeferred("a check of this peer's is pending")
        now = self.clock()
        if now - self._last.get(sender, -CHECK_EVERY_S) < CHECK_EVERY_S:
            raise CheckDeferred(f"one check every {CHECK_EVERY_S:.0f}s")
        self._asking.add(sender)  # the event loop's thread alone counts: no lock needed
        try:
            await self.line.turn(host_of(address), LINE_WAIT_S)
            # Counted once it has its turn: one deferred for a crowd may come back at once.
            self._last[sender] = now
            if len(self._last) > ASKERS_KEPT:
                self._last = {p: t for p, t in self._last.items() if now - t < CHECK_EVERY_S}
            try:
                direct, relayed, errors = await self._run(body, sender, address)
                self.checks += 1
            finally:
                self.line.done()
        finally:
            self._asking.discard(sender)
        return Reply(DialBackReply(direct=direct, relayed=relayed, errors=errors))

    async def _run(self, body: DialBackRequest, sender: str, address: str
                   ) -> tuple[str, list[str], list[str]]:
        """Dial the check's targets, one after another, until `CHECK_BUDGET_S` is spent."""
        targets, errors = await self._targets(body, address)
        direct, relayed = "", []
        ends = time.monotonic() + CHECK_BUDGET_S
        for address in targets:
            left = ends - time.monotonic()
            if left <= 0:
                errors.append(f"{address}: not tried (the check's {CHECK_BUDGET_S:.0f}s were "
                              "spent)")
                continue
            error = await _dial(self.probe, sender, address, min(DIAL_TIMEOUT_S, left))
            if error is not None:
                errors.append(f"{address}: {error}")
            elif through_relay(address):
                relayed.append(address)
            elif not direct:
                direct = address
        return direct, relayed, errors

    async def _targets(self, body: DialBackRequest, address: str
                       ) -> tuple[list[str], list[str]]:
        """What to dial: the asker's own IP on its ports, then those of its relays that run on
        the host of a peer connected to this node (or on this node's); and why others were
        left."""
        targets, errors = [], []
        host = host_of(address)
        if host and not through_relay(address):
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
            try:
                protocols = multiaddr_protocols(relay)
            except ValueError as error:  # the asker's own doing
                raise SenderFault(str(error)) from None
            if "p2p" not in protocols or not relay_id:
                raise SenderFault(f"relay {relay!r} lacks its /p2p/<peer id> part")
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


async def _dial(probe: P2P, peer: str, address: str, timeout_s: float) -> str | None:
    """None if a fresh connection to `peer` at `address` authenticated, else why not."""
    peer_id = PeerID.from_base58(peer)
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, [dialable(address)]), timeout_s)
    except TimeoutError:
        return f"no answer within {timeout_s:.0f}s"
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
                       timeout_s: float = 60.0, busy_wait_s: float = BUSY_WAIT_S) -> Reachable:
    """Ask the first of `checkers` (peer ids) that answers to dial this node back on its
    listening ports and through `relays`. A checker that says "try again later" (busy, or asked
    by this node within `CHECK_EVERY_S`), or does not answer within `timeout_s`, is passed over
    for the next; when none checked and one of them said so, all are asked again after a pause
    of one to two `CHECK_EVERY_S` (random, so a crowd of askers spreads out), for up to
    `busy_wait_s`, then CheckersBusy. When every
    checker failed otherwise (unreachable, a refusal), once more after `CHECK_EVERY_S`; then the
    report holds why each failed the last time."""
    ports = sorted({int(a.rsplit("/tcp/", 1)[1].split("/")[0]) for a in node.addresses()
                    if "/tcp/" in a and not through_relay(a)})[:MAX_PORTS]
    request = DialBackRequest(ports=[] if node.network.reachability == "relayed" else ports,
                              relays=list(relays)[:MAX_RELAYS])
    deadline = time.monotonic() + busy_wait_s
    failed_rounds = 0
    while True:
        deferred: list[str] = []
        failures: list[str] = []
        for checker in dict.fromkeys(checkers):
            try:
                reply, _ = node.call_sync(checker, DIAL_BACK, request, timeout=timeout_s)
            except (RemoteError, MessageLost, WireError) as error:
                # A refusal saying so, or no answer in time (a crowd at the checker): whether
                # this node can be reached is still unknown.
                later = (isinstance(error, PeerRefused) and TRY_LATER in str(error)) \
                    or isinstance(error, MessageLost) or isinstance(error.__cause__, TimeoutError)
                (deferred if later else failures).append(f"{checker[-8:]} did not check: {error}")
                continue
            return Reachable(reply.direct, list(reply.relayed), list(reply.errors))
        if deferred:
            pause = CHECK_EVERY_S * (1 + random.random())
            if time.monotonic() + pause > deadline:
                raise CheckersBusy(f"no peer could check whether {node.name} can be reached "
                                   f"within {busy_wait_s:.0f}s: {'; '.join(deferred)}. Start "
                                   "it again later, or join through other initial peers")
            log.info("%s: %s; asking again in %.0fs", node.name, "; ".join(deferred), pause)
            time.sleep(pause)
            continue
        failed_rounds += 1
        if failed_rounds == 2:
            return Reachable(errors=failures)
        time.sleep(CHECK_EVERY_S)


def start_reachable(name: str, initial_peers: Sequence[str], options: NetworkOptions,
                    start: StartNode, settle_s: float = 2.0) -> tuple[SwarmNode, Reachable]:
    """A node started as `options` say (`start(options)` makes one) and announced. "auto"
    first asks one of the initial peers to dial it back, then starts for good as a direct node,
    or behind its relays (the initial peers unless `options.relays`), with the same identity.
    CheckersBusy (the node stopped) when no checker had room for as long as an asker waits."""
    node = start(options)
    if options.reachability == "loopback":
        return node, Reachable()
    checkers = [peer_of(a) for a in initial_peers]
    relays = list(options.relays or initial_peers)
    try:
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
                # The relays check too: the peer that checked first answers this asker once a
                # while.
                report = check_reachability(node, [*map(peer_of, relays), *checkers], relays)
                report.errors = first.errors + report.errors
        else:
            if options.reachability == "relayed":
                time.sleep(settle_s)
            report = check_reachability(node, checkers,
                                        relays if options.reachability == "relayed" else [])
    except CheckersBusy:
        node.shutdown()
        raise
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


