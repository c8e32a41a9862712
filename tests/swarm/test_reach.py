"""How peers reach each other (net/reach.py, net/dialback.py): network options and their errors,
route records (only a peer's own counts), and the dial-back check with its refusals."""

from __future__ import annotations

import asyncio
import glob
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from helpers import unanswered_peer_address
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from decentrl.net import daemon as daemon_module
from decentrl.net import dialback
from decentrl.net import node as node_module
from decentrl.net.dialback import CheckersBusy, CheckLine, DialBackService, check_reachability
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import PeerRefused, SwarmNode, SwarmStartError
from decentrl.net.protocol import DIAL_BACK, DialBackRequest
from decentrl.net.reach import (
    NetworkOptions,
    RouteRecord,
    check_route_record,
    dialable,
    peer_options,
    route_key,
)
from decentrl.net.wire import TensorLimits, encode_struct

RELAY = "/ip4/10.250.0.3/tcp/31338/p2p/12D3KooWRUJjzVFzWkuVW3D1X9XUA2tfMHW6a76CUQrd4di1jsYk"


def test_network_options_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="reachability must be one of"):
        NetworkOptions(reachability="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a multiaddr"):
        NetworkOptions(listen=("localhost:31337",))
    with pytest.raises(ValueError, match="/ip4/<host>/tcp/<port>"):
        NetworkOptions(listen=("/dns4/example.org/tcp/1",))
    with pytest.raises(ValueError, match="needs an explicit port"):
        NetworkOptions(listen=("/ip4/0.0.0.0/tcp/1",), announce=("/ip4/192.0.2.1/tcp/0",))
    with pytest.raises(ValueError, match="lacks its /p2p/<peer id> part"):
        NetworkOptions(relays=("/ip4/10.250.0.3/tcp/31338",))
    with pytest.raises(ValueError, match="at least one relay"):
        NetworkOptions(listen=("/ip4/0.0.0.0/tcp/0",), reachability="relayed"
                       ).daemon_options([])


def test_a_swarm_elsewhere_is_joined_as_from_behind_a_home_router() -> None:
    local = "/ip4/127.0.0.1/tcp/4000/p2p/" + RELAY.rsplit("/", 1)[1]
    assert peer_options([local]) == NetworkOptions()  # loopback, as the demo and tests
    home = peer_options([RELAY])
    assert (home.reachability, home.listen) == ("auto", ("/ip4/0.0.0.0/tcp/0",))
    options, flags = home.relayed([RELAY]).daemon_options([RELAY])
    assert options["trusted_relays"] == [RELAY] and options["dht_mode"] == "client"
    assert flags == {"relayDiscovery": False, "relayService": False}
    options, flags = NetworkOptions().daemon_options([])
    assert not options["use_relay"] and not options["auto_nat"] and not flags


def test_a_relay_address_is_encoded_as_the_daemon_reads_it() -> None:
    circuit = RELAY + "/p2p-circuit"
    encoded = dialable(circuit)
    assert str(encoded) == circuit
    # hivemind writes the relay's id as a CID (0x01 0x72 ...), which the daemon refuses; the
    # raw multihash follows the /p2p/ code and its length.
    raw = encoded.to_bytes()
    assert b"\xa5\x03\x26\x00\x24" in raw and b"\x01\x72" not in raw
    assert Multiaddr(circuit).to_bytes() != raw


@pytest.mark.parametrize(("record", "error"), [
    (RouteRecord(addresses=[], relayed=False), "1 to 8 addresses"),
    (RouteRecord(addresses=["/ip4/10.0.0.1/tcp/1"] * 9, relayed=False), "1 to 8 addresses"),
    (RouteRecord(addresses=["/ip4/10.0.0.1/udp/1"], relayed=False), "TCP address"),
    (RouteRecord(addresses=["/ip4/10.0.0.1/tcp/1"], relayed=True), "relayed=True"),
    (RouteRecord(addresses=[RELAY + "/p2p-circuit"], relayed=False), "relayed=False"),
    (RouteRecord(addresses=["/ip4/10.0.0.1/tcp/1" + "/tcp/1" * 60], relayed=False),
     "over 300"),
])
def test_a_malformed_route_record_is_refused(record: RouteRecord, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        check_route_record(record)


@pytest.fixture
def checker_and_asker() -> Iterator[tuple[SwarmNode, SwarmNode, DialBackService]]:
    checker = SwarmNode.start("checker", [], LinkProfile(), TensorLimits())
    asker = SwarmNode.start("asker", checker.addresses(), LinkProfile(), TensorLimits())
    service = DialBackService(checker)
    try:
        yield checker, asker, service
    finally:
        checker.run(service.close(), timeout=30)
        asker.shutdown()
        checker.shutdown()


@pytest.mark.network
def test_the_dial_back_check_dials_the_asker_only_and_refuses_what_it_should(
        checker_and_asker: tuple[SwarmNode, SwarmNode, DialBackService]) -> None:
    checker, asker, service = checker_and_asker
    now = [0.0]
    service.clock = lambda: now[0]
    # A fresh connection from the probe daemon reaches the asker where its request came from.
    report = check_reachability(asker, [checker.peer_id], [])
    port = asker.addresses()[0].split("/tcp/")[1].split("/")[0]
    assert report.direct == f"/ip4/127.0.0.1/tcp/{port}" and report.reachable
    assert report.describe() == f"reachable directly at /ip4/127.0.0.1/tcp/{port}"
    assert service.checks == 1
    # Once per asker a while: refused, and no strike (an honest peer restarting asks again).
    now[0] += dialback.CHECK_EVERY_S - 0.1  # however long the first check took
    with pytest.raises(PeerRefused, match="one check every 5s"):
        asker.call_sync(checker.peer_id, DIAL_BACK, DialBackRequest(ports=[1], relays=[]))
    assert checker.strikes(asker.peer_id) == 0 and service.checks == 1
    # A relay that is not a peer of the checker's is not dialed (the probe is never aimed at a
    # host outside the swarm); too many ports is a malformed request, a strike.
    other = SwarmNode.start("other", [checker.addresses()[0]], LinkProfile(), TensorLimits())
    try:
        reply, _ = other.call_sync(checker.peer_id, DIAL_BACK, DialBackRequest(
            ports=[], relays=[RELAY]))
        assert (reply.direct, reply.relayed) == ("", [])
        assert reply.errors == [f"{RELAY}: not a peer connected to this one from that host"]
        with pytest.raises(PeerRefused, match="at most 4 TCP ports"):
            asker.call_sync(checker.peer_id, DIAL_BACK,
                            DialBackRequest(ports=[1, 2, 3, 4, 5], relays=[]))
        assert checker.strikes(asker.peer_id) == 1
    finally:
        other.shutdown()


@pytest.mark.network
def test_only_a_peers_own_route_record_is_read(
        checker_and_asker: tuple[SwarmNode, SwarmNode, DialBackService]) -> None:
    checker, asker, _ = checker_and_asker
    own = RouteRecord(addresses=["/ip4/127.0.0.1/tcp/4000"], relayed=False)
    asker.run(asker.announce_routes(own, 60), timeout=30)
    # A stranger writes a record under the asker's key (under its own subkey): never read.
    stranger = SwarmNode.start("stranger", [checker.addresses()[0]], LinkProfile(),
                               TensorLimits(), identity=Identity.generate())
    try:
        forged = RouteRecord(addresses=["/ip4/192.0.2.66/tcp/1"], relayed=False)
        stranger.run(stranger.announce(route_key(asker.peer_id), encode_struct(forged), 60),
                     timeout=30)
        assert checker.run(checker.routes_of(asker.peer_id), timeout=30) == own
        assert checker.run(checker.routes_of(stranger.peer_id), timeout=30) is None
        # The peer's own record, malformed, is not used either.
        bad = RouteRecord(addresses=["/ip4/127.0.0.1/udp/1"], relayed=False)
        asker.run(asker.announce(route_key(asker.peer_id), encode_struct(bad), 60),
                  timeout=30)
        assert checker.run(checker.routes_of(asker.peer_id), timeout=30) is None
        with pytest.raises(ValueError, match="TCP address"):
            asker.run(asker.announce_routes(bad, 60), timeout=30)
    finally:
        stranger.shutdown()


@pytest.mark.network
def test_a_busy_checker_says_try_again_later_and_the_asker_does(
        checker_and_asker: tuple[SwarmNode, SwarmNode, DialBackService],
        monkeypatch: pytest.MonkeyPatch) -> None:
    checker, asker, service = checker_and_asker
    service.line = CheckLine(parallel=2, per_host=4, total=0)  # two running, nobody waiting
    release = threading.Event()
    real_dial = dialback._dial

    async def held_dial(probe: Any, peer: str, address: str, timeout_s: float) -> str | None:
        await asyncio.to_thread(release.wait, 60)  # a slow check, until the test lets it go
        return await real_dial(probe, peer, address, timeout_s)

    monkeypatch.setattr(dialback, "_dial", held_dial)
    crowd = [SwarmNode.start(f"crowd{i}", [checker.addresses()[0]], LinkProfile(),
                             TensorLimits()) for i in range(2)]
    try:
        with ThreadPoolExecutor(len(crowd)) as pool:
            checks = [pool.submit(check_reachability, node, [checker.peer_id], [])
                      for node in crowd]
            wait_until(lambda: service.line.running == 2)
            # Full: refused with "try again later", no strike, and not counted as its check
            # (it may come back at once).
            with pytest.raises(PeerRefused, match="busy with 2 checks and 0 waiting; try again "
                                                  "later"):
                asker.call_sync(checker.peer_id, DIAL_BACK, DialBackRequest(ports=[1],
                                                                            relays=[]))
            assert checker.strikes(asker.peer_id) == 0 and service.checks == 0
            # An asker that cannot wait is told nobody could check, not that it is unreachable.
            with pytest.raises(CheckersBusy, match="no peer could check whether asker can be "
                                                   "reached within 0s: .*busy with 2 checks"):
                check_reachability(asker, [checker.peer_id], [], busy_wait_s=0)
            # One that waits asks again after a pause and gets its answer once there is room.
            threading.Timer(1.0, release.set).start()
            report = check_reachability(asker, [checker.peer_id], [])
            assert report.reachable and report.direct.startswith("/ip4/127.0.0.1/tcp/")
            assert all(check.result(timeout=60).reachable for check in checks)
        assert service.checks == 3 and service.pending == 0
        assert checker.strikes(asker.peer_id) == 0
    finally:
        release.set()
        for node in crowd:
            node.shutdown()


@pytest.mark.network
def test_a_stranger_asking_every_second_does_not_get_an_honest_asker_told_unreachable(
        checker_and_asker: tuple[SwarmNode, SwarmNode, DialBackService],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One check at a time here, so the honest asker waits behind the stranger's: the stranger's
    asks every second are refused while its check is pending (never queued ahead), a turn that
    does not come is "try again later", and the honest check answers once the stranger's ends."""
    checker, asker, service = checker_and_asker
    now = [0.0]
    service.clock = lambda: now[0]
    service.line = CheckLine(parallel=1, per_host=4, total=16)
    stranger = SwarmNode.start("stranger", [checker.addresses()[0]], LinkProfile(),
                               TensorLimits(), identity=Identity.generate())
    release = threading.Event()
    real_dial = dialback._dial

    async def stranger_never_answers(probe: Any, peer: str, address: str,
                                     timeout_s: float) -> str | None:
        if peer == stranger.peer_id:  # ports where nothing answers, until the test says
            await asyncio.to_thread(release.wait, 60)
            return "no answer"
        return await real_dial(probe, peer, address, timeout_s)

    monkeypatch.setattr(dialback, "_dial", stranger_never_answers)
    scan = DialBackRequest(ports=[1, 2, 3, 4], relays=[])
    try:
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(stranger.call_sync, checker.peer_id, DIAL_BACK, scan)
            wait_until(lambda: service.line.running == 1)
            for _ in range(10):  # the stranger asks again every second
                now[0] += 1.0
                with pytest.raises(PeerRefused, match="a check of this peer's is pending; try "
                                                      "again later"):
                    stranger.call_sync(checker.peer_id, DIAL_BACK, scan)
            assert service.line.waiting == 0 and checker.strikes(stranger.peer_id) == 0
            # A turn that does not come in time is "try again later", never "not reachable".
            monkeypatch.setattr(dialback, "LINE_WAIT_S", 0.0)
            with pytest.raises(CheckersBusy, match="its turn did not come within 0s"):
                check_reachability(asker, [checker.peer_id], [], busy_wait_s=0)
            monkeypatch.setattr(dialback, "LINE_WAIT_S", 60.0)
            honest = pool.submit(check_reachability, asker, [checker.peer_id], [])
            wait_until(lambda: service.line.waiting == 1)
            release.set()  # the stranger's check ends: the honest one has its turn
            report = honest.result(timeout=60)
            port = asker.addresses()[0].split("/tcp/")[1].split("/")[0]
            assert report.direct == f"/ip4/127.0.0.1/tcp/{port}"
            assert held.result(timeout=60)[0].direct == ""
        assert service.checks == 2 and service.deferred == 11 and service.pending == 0
    finally:
        release.set()
        stranger.shutdown()


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until `condition()` holds (an event of the checker's loop), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


@pytest.mark.network
def test_a_node_whose_initial_peer_refuses_it_once_starts_on_the_next_attempt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_module, "BOOTSTRAP_PAUSE_S", 0.0)
    real_start = daemon_module.start_daemon
    attempts: list[int] = []

    def refused(refusals: int) -> Any:
        async def start(*args: Any, **kwargs: Any) -> Any:
            attempts.append(1)
            if len(attempts) <= refusals:
                raise P2PDaemonError("Daemon failed to start: failed to connect to bootstrap peers")
            return await real_start(*args, **kwargs)
        return start

    tries = node_module.BOOTSTRAP_ATTEMPTS
    first = SwarmNode.start("first", [], LinkProfile(), TensorLimits())
    try:
        monkeypatch.setattr(daemon_module, "start_daemon", refused(tries - 1))
        second = SwarmNode.start("second", first.addresses(), LinkProfile(), TensorLimits())
        try:
            assert len(attempts) == tries
            assert second.daemon.dht is not None
        finally:
            second.shutdown()
        attempts.clear()
        monkeypatch.setattr(daemon_module, "start_daemon", refused(tries))
        with pytest.raises(SwarmStartError, match="none of the initial peers answered"):
            SwarmNode.start("third", first.addresses(), LinkProfile(), TensorLimits())
        assert len(attempts) == tries
    finally:
        first.shutdown()


@pytest.mark.network
def test_a_node_whose_initial_peers_do_not_answer_leaves_no_daemon_socket_behind() -> None:
    """p2pd listens on its control socket before it dials the initial peers, and exits without
    removing it when none answers."""
    with unanswered_peer_address(RELAY.rsplit("/", 1)[1]) as address:
        sockets_before = set(glob.glob("/tmp/hivemind-*.sock"))
        with pytest.raises(SwarmStartError, match="none of the initial peers answered"):
            SwarmNode.start("lonely", [address], LinkProfile(), TensorLimits())
    # New sockets of daemons that other processes on this machine started meanwhile are live.
    new = set(glob.glob("/tmp/hivemind-*.sock")) - sockets_before
    assert not [path for path in new if nobody_listens(path)]


@pytest.mark.network
def test_a_route_record_cannot_aim_a_node_at_a_third_host(
        checker_and_asker: tuple[SwarmNode, SwarmNode, DialBackService]) -> None:
    """A stranger's record naming 8 ports of another host (127.0.0.2 here), directly and as
    circuits through relays nobody knows, is never dialed; an honest peer's own route, at the
    host it was seen at, still is."""
    checker, asker, _ = checker_and_asker
    stranger = SwarmNode.start("stranger", [checker.addresses()[0]], LinkProfile(),
                               TensorLimits(), identity=Identity.generate())
    third_host = [socket.create_server(("127.0.0.2", 0)) for _ in range(8)]
    try:
        ports = [server.getsockname()[1] for server in third_host]
        scan = RouteRecord(addresses=[f"/ip4/127.0.0.2/tcp/{port}" for port in ports],
                           relayed=False)
        relay = Identity.generate().peer_id
        circuits = RouteRecord(addresses=[f"/ip4/127.0.0.2/tcp/{port}/p2p/{relay}/p2p-circuit"
                                          for port in ports], relayed=True)
        # Once the stranger is gone (the daemon's connect returns at once for a peer it is
        # connected to, dialing nothing), its records stay in the DHT for their lifetime.
        stranger.run(stranger.announce_routes(scan, 60), timeout=30)
        stranger.shutdown()
        assert not checker.run(checker.routing.connect(stranger.peer_id), timeout=60)
        assert checker.route_screen.refused == 8
        # Circuits through a relay nobody knows, at that host, are not dialed either.
        assert checker.route_screen.usable(stranger.peer_id, circuits, {}) == []
        assert checker.route_screen.refused == 16
        for server in third_host:  # nothing ever connected to the third host
            server.setblocking(False)
            with pytest.raises(BlockingIOError):
                server.accept()
        # The honest asker's route at the host it reached the checker from is dialed.
        asker.call_sync(checker.peer_id, DIAL_BACK, DialBackRequest(ports=[], relays=[]))
        own = RouteRecord(addresses=[asker.addresses()[0].rsplit("/p2p/", 1)[0]],
                          relayed=False)
        asker.run(asker.announce_routes(own, 60), timeout=30)
        assert checker.run(checker.routing.connect(asker.peer_id), timeout=60)
        assert checker.route_screen.refused == 16
    finally:
        for server in third_host:
            server.close()
        stranger.shutdown()


def nobody_listens(path: str) -> bool:
    """Whether the unix socket file `path` is left behind by a daemon that is gone."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except FileNotFoundError:  # removed meanwhile
            return False
    return False
