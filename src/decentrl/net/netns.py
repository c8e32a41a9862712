"""A small internet on one machine: separate hosts made of Linux network namespaces, for the tests
and `decentrl demo --netns`.

    public segment 10.250.0.0/24 (a bridge in the `internet` namespace)
      public hosts      10.250.0.2, .3, ...       (the coordinator, a relay-capable peer)
      home k's router   10.250.0.(100 + k)         WAN side, uplink capped by a tc token bucket
        home k's LAN    192.168.k.0/24 behind it   nftables masquerade, nothing forwarded inward

Every host is its own namespace with its own loopback; a process is put in one with
`ip netns exec` (`Internet.command`). A home host reaches the public segment through its router's
NAT; nothing on the public segment can open a connection to a home host, and homes cannot reach
each other's LANs: the kernel enforces it, as on the internet. The namespaces are joined to each
other only, never to this machine's own network: every address exists only inside them. The
kernel here has no netem, so latency and jitter stay emulated by net/link.py.

Everything made is named with the harness's own id (`dcl<id>-...`) and removed by `close()`,
which kills the processes left in its namespaces first; it also runs at interpreter exit and on
SIGTERM/SIGINT of the process that built it. `Internet.start` refuses with `NetnsUnavailable`
where it lacks the privileges or the tools."""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Literal, Self

from decentrl.errors import DecentrlError
from decentrl.net.reach import NetworkOptions

PUBLIC_SUBNET = ipaddress.ip_network("10.250.0.0/24")
ROUTER_WAN_BASE = 100  # home k's router is 10.250.0.(100 + k) on the public segment
MAX_HOMES = 50
MAX_HOSTS_PER_HOME = 50
COMMAND_TIMEOUT_S = 30.0
TOOLS = ("ip", "nft", "tc")
HostKind = Literal["public", "home"]


class NetnsUnavailable(DecentrlError, RuntimeError):
    """This machine cannot build the namespaces: not root, or a tool (ip, nft, tc) is missing."""


class NetnsError(DecentrlError, RuntimeError):
    """A command that builds or changes the namespaces failed."""


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    kind: HostKind
    home: int | None = None  # the home network it sits in, for a host behind NAT

    @property
    def behind_nat(self) -> bool:
        return self.kind == "home"


@dataclass(frozen=True)
class HomeSpec:
    """A home network: its hosts (behind one NAT router) and its uplink cap."""

    hosts: Sequence[str]
    uplink_mbit: float = 100.0


@dataclass
class Internet:
    """Build with `Internet.start(public=[...], homes=[HomeSpec(...), ...])`; use as a context
    manager or call `close()`."""

    id: str
    hosts: dict[str, Host] = field(default_factory=dict)
    routers: dict[int, str] = field(default_factory=dict)  # home -> router namespace
    namespaces: list[str] = field(default_factory=list)  # in the order made
    _closed: bool = False

    @classmethod
    def start(cls, public: Sequence[str], homes: Sequence[HomeSpec],
              id: str | None = None) -> Internet:
        check_privileges()
        names = [*public, *(h for home in homes for h in home.hosts)]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique, got {names}")
        if not public or len(public) > ROUTER_WAN_BASE - 2:
            raise ValueError(f"need 1 to {ROUTER_WAN_BASE - 2} public hosts, got {len(public)}")
        if len(homes) > MAX_HOMES or any(not 0 < len(h.hosts) <= MAX_HOSTS_PER_HOME
                                         for h in homes):
            raise ValueError(f"need at most {MAX_HOMES} homes of 1 to {MAX_HOSTS_PER_HOME} "
                             "hosts each")
        for home in homes:
            if home.uplink_mbit <= 0:
                raise ValueError(f"uplink_mbit must be > 0, got {home.uplink_mbit}")
        internet = cls(id=id or secrets.token_hex(3))
        _install_signal_handlers()
        _live.append(internet)
        try:
            internet._build(public, homes)
        except BaseException:
            internet.close()
            raise
        return internet

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- using it ------------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def run(self, host: str, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True,
                              timeout=timeout, check=False)

    def throttle(self, home: int, uplink_mbit: float) -> None:
        """Change home `home`'s uplink cap now (a hard throttle mid-run, or its lifting)."""
        if uplink_mbit <= 0:
            raise ValueError(f"uplink_mbit must be > 0, got {uplink_mbit}")
        _tbf(self.routers[home], "wan0", uplink_mbit, "change")

    def node_options(self, host: str, relays: Sequence[str] = ()) -> NetworkOptions:
        """How an in-process node whose daemon sits on `host` is reached: on the public segment
        directly (relaying for others), behind NAT through `relays` (full multiaddrs)."""
        where = self.hosts[host]
        listen = (f"/ip4/{where.address}/tcp/0",)
        if where.behind_nat:
            return NetworkOptions(listen, relays=tuple(relays), reachability="relayed",
                                  netns=where.namespace)
        return NetworkOptions(listen, reachability="direct", relay_service=True,
                              netns=where.namespace)

    def public_hosts(self) -> list[Host]:
        return [h for h in self.hosts.values() if not h.behind_nat]

    def describe(self) -> list[str]:
        """One line per host: where it sits and how it reaches the rest."""
        lines = []
        for host in self.hosts.values():
            where = (f"home {host.home} behind NAT 10.250.0.{ROUTER_WAN_BASE + host.home}"
                     if host.home is not None else "public segment")
            lines.append(f"{host.name}: {host.address} ({where})")
        return lines

    # ---- building ------------------------------------------------------------------------

    def _namespace(self, suffix: str) -> str:
        name = f"dcl{self.id}-{suffix}"
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def _build(self, public: Sequence[str], homes: Sequence[HomeSpec]) -> None:
        core = self._namespace("internet")
        _ip("-n", core, "link", "add", "br0", "type", "bridge")
        _ip("-n", core, "link", "set", "br0", "up")
        port = 0

        def attach(namespace: str, device: str, address: str, prefix: int) -> None:
            nonlocal port
            port += 1
            _ip("link", "add", device, "netns", namespace, "type", "veth", "peer", "name",
                f"p{port}", "netns", core)
            _ip("-n", core, "link", "set", f"p{port}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/{prefix}", "dev", device)
            _ip("-n", namespace, "link", "set", device, "up")

        for index, name in enumerate(public):
            namespace = self._namespace(f"h{index}")
            address = str(PUBLIC_SUBNET.network_address + 2 + index)
            attach(namespace, "eth0", address, PUBLIC_SUBNET.prefixlen)
            self.hosts[name] = Host(name, namespace, address, "public")
        for k, home in enumerate(homes, start=1):
            router = self._namespace(f"r{k}")
            self.routers[k] = router
            attach(router, "wan0", str(PUBLIC_SUBNET.network_address + ROUTER_WAN_BASE + k),
                   PUBLIC_SUBNET.prefixlen)
            _ip("-n", router, "link", "add", "lan0", "type", "bridge")
            _ip("-n", router, "addr", "add", f"192.168.{k}.1/24", "dev", "lan0")
            _ip("-n", router, "link", "set", "lan0", "up")
            _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            _nft(router, NAT_RULES)
            _tbf(router, "wan0", home.uplink_mbit, "add")
            for j, name in enumerate(home.hosts):
                namespace = self._namespace(f"r{k}h{j}")
                address = f"192.168.{k}.{10 + j}"
                _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name",
                    f"l{j}", "netns", router)
                _ip("-n", router, "link", "set", f"l{j}", "master", "lan0", "up")
                _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "route", "add", "default", "via", f"192.168.{k}.1")
                self.hosts[name] = Host(name, namespace, address, "home", k)

    # ---- tearing down --------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the namespaces, then remove them (their veths go with them).
        Safe to call twice, and from a signal handler."""
        if self._closed:
            return
        self._closed = True
        for namespace in reversed(self.namespaces):
            _kill_processes(namespace)
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True,
                           timeout=COMMAND_TIMEOUT_S, check=False)
        if self in _live:
            _live.remove(self)


# Home routers: masquerade what leaves by the WAN side; forward the LAN's own connections out and
# their replies in, and nothing else (no inbound port forwarding, as a home router by default).
# Where br_netfilter is loaded, frames between two hosts of the LAN pass this hook too.
NAT_RULES = """
table ip nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
}
table ip filter {
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
        iifname "lan0" oifname "lan0" accept
    }
}
"""


def check_privileges() -> None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(
            f"building network namespaces needs {', '.join(missing)} on PATH (Debian: "
            "apt-get install iproute2 nftables)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("building network namespaces needs root (CAP_NET_ADMIN and "
                               "CAP_SYS_ADMIN): run as root, e.g. with sudo")
    probe = f"dclprobe-{secrets.token_hex(3)}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"this machine refuses to make a network namespace: "
                               f"{result.stderr.strip()} (a container without CAP_SYS_ADMIN?)")
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True,
                   timeout=COMMAND_TIMEOUT_S, check=False)


def _run(argv: Sequence[str], input: str | None = None) -> None:
    result = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _nft(namespace: str, rules: str) -> None:
    _run(["ip", "netns", "exec", namespace, "nft", "-f", "-"], input=rules)


def _tbf(namespace: str, device: str, mbit: float, verb: Literal["add", "change"]) -> None:
    # A burst of at least one MTU-sized packet per timer tick at this rate; 50 ms of queue.
    burst = max(16_000, int(mbit * 1e6 / 8 / 100))
    _run(["ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", device, "root", "tbf",
          "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"])


def _kill_processes(namespace: str) -> None:
    result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S, check=False)
    pids = [int(p) for p in result.stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Every Internet not closed yet: removed at interpreter exit and on SIGTERM/SIGINT.
_live: list[Internet] = []


def _close_all() -> None:
    for internet in _live:
        internet.close()


_handlers_installed = False


def _install_signal_handlers() -> None:
    """Close every namespace on SIGTERM/SIGINT, then do what the signal did before (SIGINT:
    KeyboardInterrupt). Only from the main thread, where Python lets a handler be set."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(number: int, frame: FrameType | None,
                    previous: object = previous) -> None:
            _close_all()
            if callable(previous):
                previous(number, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(number, signal.SIG_DFL)
                os.kill(os.getpid(), number)
        signal.signal(signum, handler)


atexit.register(_close_all)
