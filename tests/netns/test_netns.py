"""The small internet of net/netns.py: the kernel really separates its hosts, NATs the homes,
caps their uplinks, and everything it made is gone after close(), also its processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from decentrl.net import netns
from decentrl.net.netns import HomeSpec, Internet, NetnsUnavailable

# A TCP echo of the connecting address: who a server sees, or that nobody reached it.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen(); s.settimeout(float(sys.argv[1]))
print("listening", flush=True)
try:
    c, address = s.accept(); print(address[0], flush=True)
except TimeoutError:
    print("nobody", flush=True)
"""
CLIENT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 7000), timeout=1.5).close(); print("connected")
except OSError as error:
    print("failed", type(error).__name__)
"""


def netns_or_skip() -> None:
    try:
        netns.check_privileges()
    except NetnsUnavailable as error:
        pytest.skip(f"network namespaces unavailable here: {error}")


@pytest.fixture(scope="module")
def internet() -> Iterator[Internet]:
    netns_or_skip()
    with Internet.start(["coordinator", "relay"],
                        [HomeSpec(["alice", "alice2"], uplink_mbit=8), HomeSpec(["bob"])]) as net:
        yield net


def connect(net: Internet, source: str, target: str, address: str | None = None) -> str:
    """What the server on `target` saw when `source` dialed it: an address or "nobody"."""
    server = subprocess.Popen(net.command(target, [sys.executable, "-c", SERVER, "3"]),
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline() == "listening\n"  # dialed only once it listens
    net.run(source, [sys.executable, "-c", CLIENT, address or net.hosts[target].address])
    out, _ = server.communicate(timeout=10)
    return out.strip()


@pytest.mark.network
def test_homes_reach_the_public_segment_through_their_nat_and_nothing_reaches_in(
        internet: Internet) -> None:
    hosts = internet.hosts
    assert [h.behind_nat for h in hosts.values()] == [False, False, True, True, True]
    # Out through the router: the coordinator sees the router's WAN address, not the host's.
    assert connect(internet, "alice", "coordinator") == "10.250.0.101"
    assert connect(internet, "bob", "relay") == "10.250.0.102"
    # In: the LAN address has no route from outside, and the router forwards nothing inward.
    assert connect(internet, "coordinator", "alice") == "nobody"
    assert connect(internet, "coordinator", "alice", "10.250.0.101") == "nobody"
    # Another home's LAN is out of reach; the same LAN is direct.
    assert connect(internet, "bob", "alice") == "nobody"
    assert connect(internet, "alice2", "alice") == hosts["alice2"].address
    assert connect(internet, "coordinator", "relay") == hosts["coordinator"].address


@pytest.mark.network
def test_a_home_uplink_is_capped_and_can_be_throttled(internet: Internet) -> None:
    def qdisc() -> str:
        return subprocess.run(["ip", "netns", "exec", internet.routers[1], "tc", "qdisc", "show",
                               "dev", "wan0"], capture_output=True, text=True).stdout

    assert "tbf" in qdisc() and "rate 8Mbit" in qdisc()
    internet.throttle(1, 0.5)
    assert "rate 500Kbit" in qdisc()
    internet.throttle(1, 8)
    with pytest.raises(ValueError, match="uplink_mbit must be > 0"):
        internet.throttle(1, 0)


def namespace_pids(namespace: str) -> set[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                            check=True).stdout
    return {int(pid) for pid in listed.split()}


@pytest.mark.network
def test_close_kills_its_processes_and_removes_every_namespace() -> None:
    netns_or_skip()
    net = Internet.start(["a"], [HomeSpec(["b"])])
    sleeper = subprocess.Popen(net.command("b", ["sleep", "600"]))
    made = list(net.namespaces)
    assert len(made) == 4  # the internet's bridge, a, b's router, b
    # Closed once the sleeper is inside b: closing kills what it finds in each namespace, and
    # `ip netns exec` enters its namespace a moment after it starts.
    home = net.hosts["b"].namespace
    while sleeper.pid not in namespace_pids(home) and sleeper.poll() is None:
        pass
    assert sleeper.poll() is None, "the sleeper did not start"
    net.close()
    assert sleeper.wait(timeout=10) != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)
    assert f"dcl{net.id}" not in listed
    net.close()  # twice is fine


def test_without_privileges_it_refuses_and_names_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    with pytest.raises(NetnsUnavailable, match="needs root"):
        Internet.start(["a"], [HomeSpec(["b"])])
    monkeypatch.setattr(netns.shutil, "which",
                        lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    with pytest.raises(NetnsUnavailable, match="needs nft on PATH"):
        Internet.start(["a"], [HomeSpec(["b"])])


def test_a_bad_topology_is_refused_before_anything_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    with pytest.raises(ValueError, match="host names must be unique"):
        Internet.start(["a"], [HomeSpec(["a"])])
    with pytest.raises(ValueError, match="uplink_mbit must be > 0"):
        Internet.start(["a"], [HomeSpec(["b"], uplink_mbit=0)])
    with pytest.raises(ValueError, match="public hosts"):
        Internet.start([], [HomeSpec(["b"])])
