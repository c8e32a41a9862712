"""Starting peers: `join` (one stage peer in this process, until it is told to stop) and
`LocalSwarm` (the coordinator and every peer as separate processes on loopback, for the demo and
the multi-process tests). Each child runs in its own process group, so stopping it also stops its
p2pd daemon, and the unix sockets a killed daemon leaves behind are removed."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from decentrl.config import RunConfig, parse_config
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import (
    CoordinatorRecord,
    PeerRecord,
    Role,
    coordinator_key,
    layer_span,
    stage_key,
)
from decentrl.net.records import decode_records
from decentrl.net.wire import TensorLimits
from decentrl.progress import progress_bar
from decentrl.swarm.adversary import (
    ADVERSARIES,
    adversary_stages,
    flood,
    hostile_peer,
    submit_replays,
)
from decentrl.swarm.peer import StagePeer

log = logging.getLogger(__name__)

READY = "DECENTRL-READY"
LOOKUP_TIMEOUT_S = 30.0
INFERENCE_NICENESS = 10


def yield_cpu(niceness: int) -> None:
    """Lower this process's CPU priority, in a child after setsid. Linux puts every session in an
    autogroup and shares the CPU fairly between autogroups, whatever the nice value of a process
    inside one: the group's own nice value is what makes a session yield."""
    os.nice(niceness)
    try:
        Path("/proc/self/autogroup").write_text(str(niceness))
    except OSError:
        pass  # not Linux, or autogroups are off: the process's nice value is enough


def link_profile(config: RunConfig) -> LinkProfile:
    link = config.swarm.link
    return LinkProfile(rtt_ms=link.rtt_ms, jitter_ms=link.jitter_ms,
                       bandwidth_mbps=link.bandwidth_mbps, uplink_mbps=link.uplink_mbps,
                       loss=link.loss, seed=config.seed)


def fetch_config(node: SwarmNode, run: str, timeout_s: float, stop: threading.Event,
                 console: Console) -> RunConfig | None:
    """The run config the coordinator announces (a peer started without --config), waited for
    at most `timeout_s`; None once `stop` is set."""
    waiting = f"waiting for the coordinator of run {run!r} to announce its config"
    console.print(f"{waiting} (up to {timeout_s:.0f}s)", markup=False, highlight=False)
    with progress_bar(console, escape(waiting), timeout_s, counted=False) as update:
        started = time.monotonic()
        while not stop.is_set() and (waited := time.monotonic() - started) < timeout_s:
            update(waited)
            entries = node.run(node.lookup(coordinator_key(run)), timeout=LOOKUP_TIMEOUT_S)
            records, _ = decode_records(entries, CoordinatorRecord)
            if len(records) > 1:
                # Anyone can sign a config record of their own under the run's key; until the
                # run's owner is known, a peer cannot tell which is the coordinator's.
                raise RuntimeError(f"{len(records)} peers announce a config for run {run!r}: "
                                   "cannot tell which is the coordinator's; join with --config")
            if records:
                record = next(iter(records.values()))
                return parse_config(json.loads(record.config_json))
            stop.wait(1.0)
    if stop.is_set():
        console.print("stopped before the coordinator's config arrived")
        return None
    raise TimeoutError(f"no coordinator of run {run!r} announced a config within "
                       f"{timeout_s:.0f}s: check the run name in the join command the coordinator "
                       "printed (it is also in the run folder's join.txt), and that the "
                       "coordinator is running")


def choose_stage(node: SwarmNode, config: RunConfig, role: Role) -> int:
    """`--stage auto`: a training peer takes the first stage without one; an inference peer takes
    the stage with the least free capacity (fewest free sessions, then fewest replicas)."""
    capacity = []
    for stage in range(config.num_stages):
        found, skipped = decode_records(node.run(node.lookup(stage_key(config.name, stage)),
                                                 timeout=LOOKUP_TIMEOUT_S), PeerRecord, stage)
        if skipped:
            log.warning("stage %d: skipped %d malformed announcements", stage, skipped)
        records = list(found.values())
        if role == "training":
            capacity.append((sum(r.training_ready for r in records), stage))
        else:
            serving = [r for r in records if r.role != "training"]
            capacity.append((sum(r.free_sessions for r in serving) + len(serving), stage))
    return min(capacity)[1]


def print_json_line(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def join(config: RunConfig | None, run: str | None, stage: int | None, role: Role,
         initial_peers: list[str], checkpoint_dir: Path | None, name: str,
         stop: threading.Event, exit_with_parent: bool = False, adversary: str | None = None,
         collusion_dir: Path | None = None, report: Callable[[dict[str, Any]], None] =
         print_json_line, console: Console | None = None, config_wait_s: float = 300) -> None:
    """Run one stage peer until `stop` is set (or, with `exit_with_parent`, until the process
    that started it is gone: a launcher that dies must not leave peers behind). `report` gets
    its sockets first (whoever started it must be able to remove them if it dies), then, once
    it serves, a READY event: peer id, run, stage, layers ("0-14"), role, addresses.
    `adversary` makes it a hostile peer (swarm/adversary.py): a stage peer that lies, or a client
    that attacks. `console` shows the wait for the coordinator's config."""
    if config is None and run is None:
        raise ValueError("join needs --config or --run (to fetch the coordinator's config)")
    parent = os.getppid()
    profile = link_profile(config) if config is not None else LinkProfile()
    threads = config.threads if config is not None and config.threads else None
    node = SwarmNode.start(name, initial_peers, profile, TensorLimits(), compute_threads=threads)
    report({"sockets": node.socket_paths()})
    try:
        if config is None:
            assert run is not None
            config = fetch_config(node, run, config_wait_s, stop,
                                  console or Console(stderr=True))
            if config is None:
                return

        def until_stopped() -> None:
            while not stop.wait(1.0):
                if exit_with_parent and os.getppid() != parent:
                    log.warning("%s: the launcher is gone; stopping", name)
                    break
            stop.set()

        ready = {"ready": READY, "name": name, "peer_id": node.peer_id, "run": config.name,
                 "addresses": node.addresses()}
        if adversary in ("replay", "flood"):
            report({**ready, "role": adversary})
            watcher = threading.Thread(target=until_stopped, daemon=True)
            watcher.start()
            attack = submit_replays if adversary == "replay" else flood
            attack(node, config, stop)
            return
        chosen = stage if stage is not None else choose_stage(node, config, role)
        if adversary is not None:
            peer = hostile_peer(config, chosen, node, name, adversary, collusion_dir, role,
                                checkpoint_dir)
        else:
            peer = StagePeer(config, chosen, role, node, checkpoint_dir, name)
        peer.start()
        report({**ready, "stage": chosen, "num_stages": config.num_stages,
                "layers": layer_span(peer.layers), "role": role})
        until_stopped()
        peer.stop()
    finally:
        node.shutdown()


# ---- a whole swarm on this machine ---------------------------------------------------------

@dataclass
class Child:
    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    restarts: int = 0


class LocalSwarm:
    """The coordinator plus, per stage, `replicas` inference peers and one training peer, each a
    separate `decentrl` process on loopback, logging into `<run>/logs/`."""

    def __init__(self, config: RunConfig, config_path: Path, replicas: int,
                 training: bool = True, adversaries: Sequence[str] = ()) -> None:
        """`training=False` starts inference replicas only (generation benchmarks).
        `adversaries` adds hostile peers (swarm/adversary.py) beside the honest ones."""
        self.config, self.config_path, self.replicas = config, config_path, replicas
        self.training = training
        self.adversaries = list(adversaries)
        self.logs = config.path / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.bootstrap: SwarmNode | None = None
        self.children: dict[str, Child] = {}
        self.sockets: set[str] = set()

    def start(self, on_ready: Callable[[Child], None] = lambda child: None) -> list[str]:
        """A bootstrap DHT node in this process (it routes nothing else), then every peer;
        `on_ready` hears of each peer as it becomes ready (loading a stage takes a while)."""
        # The coordinator runs on this node: its calls are the hops, so they cross emulated links.
        self.bootstrap = SwarmNode.start("bootstrap", [], link_profile(self.config),
                                         TensorLimits())
        addresses = self.bootstrap.addresses()
        checkpoints = self.config.path / "checkpoints"
        for stage in range(self.config.num_stages):
            if self.training:
                self._add(f"train{stage}", ["join", "--stage", str(stage), "--role", "training",
                                            "--checkpoint-dir", str(checkpoints)], addresses)
            for replica in range(self.replicas):
                self._add(f"infer{stage}.{replica}", ["join", "--stage", str(stage), "--role",
                                                      "inference"], addresses)
        collusion = self.config.path / "collusion"  # where an inject-answers pair meets
        for kind in self.adversaries:
            collusion.mkdir(exist_ok=True)
            if kind not in ADVERSARIES:
                raise ValueError(f"unknown adversary {kind!r}; one of {ADVERSARIES}")
            stages = adversary_stages(kind, self.config.num_stages)
            for stage in stages or ["auto"]:
                self._add(f"adv-{kind}" + (f".{stage}" if stages else ""),
                          ["join", "--stage", str(stage), "--role", "inference", "--adversary",
                           kind, "--collusion-dir", str(collusion)], addresses)
        for child in self.children.values():
            self._spawn(child)
        for child in self.children.values():
            self._wait_ready(child, timeout_s=300)
            on_ready(child)
        return addresses

    def _add(self, name: str, args: list[str], addresses: list[str]) -> None:
        full = [*args, "--config", str(self.config_path), "--name", name, "--exit-with-parent",
                "--log-json"]
        for address in addresses:
            full += ["--initial-peers", address]
        self.children[name] = Child(name, full, self.logs / f"{name}.log")

    def _spawn(self, child: Child) -> None:
        # On one machine every peer competes for the same cores, which separate machines would
        # not; the training chain is the critical path, so inference replicas yield to it.
        niceness = INFERENCE_NICENESS if "--role" in child.args and \
            child.args[child.args.index("--role") + 1] == "inference" else 0
        with child.log_path.open("a") as log_file:
            child.process = subprocess.Popen(
                [sys.executable, "-m", "decentrl.cli", *child.args], stdout=subprocess.PIPE,
                stderr=log_file, text=True, start_new_session=True,
                preexec_fn=(lambda: yield_cpu(niceness)) if niceness else None)
        child.info = {}

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        assert child.process is not None and child.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        said: list[str] = []
        while time.monotonic() < deadline:
            line = child.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{child.name} exited before it was ready: "
                                   f"{' '.join(said)[-500:] or 'no output'}; see {child.log_path}")
            if line.startswith("{"):
                info = json.loads(line)
                child.info.update(info)
                self.sockets.update(info.get("sockets", []))  # cleaned up even if it fails later
                if info.get("ready") == READY:
                    return
            else:
                said.append(line.strip())
        raise TimeoutError(f"{child.name} was not ready within {timeout_s:.0f}s")

    def layout(self) -> list[str]:
        return [self.describe(child) for child in self.children.values()]

    @staticmethod
    def describe(child: Child) -> str:
        """A ready peer: its stage, layers, role and process id."""
        return (f"{child.name}: stage {child.info.get('stage')} layers "
                f"{child.info.get('layers')} ({child.info.get('role')}, pid "
                f"{child.process.pid if child.process else '-'})")

    def kill(self, name: str) -> None:
        """SIGKILL a peer and its daemon (a crash, not a goodbye), then remove its sockets."""
        child = self.children[name]
        if child.process is not None and child.process.poll() is None:
            os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()
        self._remove_sockets(child)

    def restart(self, name: str) -> None:
        child = self.children[name]
        self.kill(name)
        child.restarts += 1
        self._spawn(child)
        self._wait_ready(child, timeout_s=300)

    def chaos(self, stop: threading.Event, every_s: float, seed: int,
              on_event: callable = print) -> None:  # type: ignore[valid-type]
        """Kill and restart a random peer every `every_s` seconds until `stop` is set."""
        rng = random.Random(seed)
        while not stop.wait(every_s):
            name = rng.choice(sorted(self.children))
            on_event(f"chaos: killing {name}")
            try:
                self.restart(name)
                on_event(f"chaos: {name} is back")
            except (RuntimeError, TimeoutError) as error:
                if not stop.is_set():  # at the end, shutting the swarm down stops a restart
                    on_event(f"chaos: {name} did not come back: {error}")

    def _remove_sockets(self, child: Child) -> None:
        for path in child.info.get("sockets", []):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            self.sockets.discard(path)

    def shutdown(self) -> None:
        for child in self.children.values():
            if child.process is not None and child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        for child in self.children.values():
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
            self._remove_sockets(child)
        if self.bootstrap is not None:
            self.bootstrap.shutdown()
