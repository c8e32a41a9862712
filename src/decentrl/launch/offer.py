"""What a training peer offers a run whose owner plans the stages from its peers: the memory it
gives the model and its measured speed, announced as a `HostOffer` (net/protocol.py) under its
own key while it waits for the run's manifest (launch/join.py). The owner plans from the offers
of its admitted training peers (coordinator/planning.py).

Memory is the peer's own limit where it has one (`host.memory_limit_mb`: the launcher enforces
it with a cgroup), else what its device holds: a CUDA device's total memory, or the memory the
operating system has available. Speed is measured, not declared: a square matrix product in the
peer's compute dtype, on its device, with its threads, the best of a few; GFLOP/s compare any
two hosts, which is all the planner needs (it divides layers in proportion to speed)."""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from decentrl.config import HostConfig
from decentrl.device import compute_dtype, pick_device
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import HostOffer, Role, offer_key
from decentrl.net.wire import encode_struct

log = logging.getLogger(__name__)

MIB = 2**20
# The matrix product that measures a host: large enough to run at a core's full rate, small
# enough that a few repeats take well under a second on a laptop's CPU.
PROBE_SIZE = 512
PROBE_REPEATS = 5


def host_memory_mb(host: HostConfig, device: torch.device) -> int:
    """The memory this peer gives the model, in MiB: its limit, or what its device holds."""
    if host.memory_limit_mb:
        return host.memory_limit_mb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // MIB
    return available_memory_mb()


def available_memory_mb() -> int:
    """The memory the operating system says is available now (Linux's MemAvailable; elsewhere
    the physical memory, which is all a Mac or another system tells without a dependency)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB


def measured_gflops(device: torch.device, dtype: torch.dtype) -> float:
    """GFLOP/s of a PROBE_SIZE square matrix product on `device` in `dtype` (with the torch
    threads this process set), the best of PROBE_REPEATS after one warm-up."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(device, dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(device, dtype)
    best = float("inf")
    for repeat in range(PROBE_REPEATS + 1):
        started = time.perf_counter()
        (a @ b).sum().item()  # .item() waits for an asynchronous device
        if repeat:
            best = min(best, time.perf_counter() - started)
    return 2 * PROBE_SIZE**3 / max(best, 1e-9) / 1e9


def host_offer(run: str, role: Role, host: HostConfig) -> HostOffer:
    """This host's offer to run `run`, measured now."""
    device = pick_device(host.device)
    speed = measured_gflops(device, compute_dtype(device, host.dtype))
    return HostOffer(run=run, role=role, memory_mb=host_memory_mb(host, device), speed=speed)


class OfferAnnouncer:
    """Announces `offer` under this peer's offer key every `every_s` (each record living a few
    periods) until `stop`: a peer waiting for its run's plan keeps offering until it has one."""

    def __init__(self, node: SwarmNode, offer: HostOffer, every_s: float) -> None:
        self.node, self.offer, self.every_s = node, offer, every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offer", daemon=True)

    def start(self) -> OfferAnnouncer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.every_s + 30)

    def _run(self) -> None:
        key = offer_key(self.node.peer_id)
        body = encode_struct(self.offer)
        while not self._stopped.is_set():
            try:
                self.node.run(self.node.announce(key, body, 5 * self.every_s), timeout=30)
            except Exception as error:  # noqa: BLE001 - the next round tries again
                log.info("announcing this peer's offer failed: %s", error)
            self._stopped.wait(self.every_s)
