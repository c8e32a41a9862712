"""A whole swarm on this machine: `LocalSwarm` starts the coordinator and every peer as separate
processes on loopback (or on hosts of an `Internet`), for the demo and the multi-process tests.
Each child runs in its own process group, so stopping it also stops its p2pd daemon, and the unix
sockets a killed daemon leaves behind are removed."""

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from decentrl.config import RunConfig
from decentrl.coordinator.manifest import (
    admit,
    owner_identity,
    publish_manifest,
    run_manifest,
)
from decentrl.coordinator.planning import OfferPlan, planned_run
from decentrl.launch.adversary import (
    ADVERSARIES,
    TRAINING_ADVERSARIES,
    adversary_stages,
)
from decentrl.launch.join import INFERENCE_NICENESS, READY, link_profile, yield_cpu
from decentrl.launch.memory_limit import MIB, MemoryCgroup
from decentrl.net.dialback import DialBackService
from decentrl.net.identity import Identity
from decentrl.net.netns import Internet
from decentrl.net.node import LOOPBACK_ONLY, SwarmNode
from decentrl.net.protocol import Role
from decentrl.net.reach import NetworkOptions
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits
from decentrl.observe.metrics import ChaosAction

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    restarts: int = 0
    spawned_at: float = 0.0  # monotonic
    memory: MemoryCgroup | None = None  # its cap (host.memory_limit_mb), kept across restarts

    def started(self, process: subprocess.Popen) -> None:
        """`process` runs this child now: what an earlier one reported is void."""
        self.process, self.info, self.spawned_at = process, {}, time.monotonic()


class LocalSwarm:
    """The coordinator plus, per stage, `replicas` inference peers and one training peer, each a
    separate `decentrl` process on loopback, logging into `<run>/logs/`. Its bootstrap node is
    the run's owner: the coordinator runs on it.

    With `internet` (net/netns.py), every process sits on a host of its own there instead:
    `placement` maps "coordinator" and each peer's name (train0, infer0.0, ...) to a host name
    (unplaced peers go to the coordinator's host), and a `decentrl relay` runs on each host of
    `relays`. Peers join as they would from a home: they learn whether they can be dialed and
    use the relays (and the coordinator) if not."""

    def __init__(self, config: RunConfig, config_path: Path, replicas: int,
                 training: bool = True, adversaries: Sequence[str] = (),
                 internet: Internet | None = None, placement: Mapping[str, str] | None = None,
                 relays: Sequence[str] = (), training_role: Role = "training",
                 memory_limits_mb: Mapping[str, int] | None = None,
                 plan_from_offers: bool = False) -> None:
        """`training=False` starts inference replicas only (generation benchmarks).
        `adversaries` adds hostile peers (launch/adversary.py) beside the honest ones.
        `training_role="both"`: the training peers serve inference too (one process a stage
        can then hold a model's slice once, for training and generation).
        `memory_limits_mb`: a peer's own memory cap by name (train0, ...), instead of the
        config's `host.memory_limit_mb`; the peer offers it as its memory.
        `plan_from_offers`: the training peers start first and offer their memory and speed,
        the stages are planned from those offers (coordinator/planning.py; the config must
        leave `stage_layers` empty), and `config` becomes the planned one (`planned` says
        why)."""
        if plan_from_offers and (config.stage_layers or not training):
            raise ValueError("planning from offers needs training peers and a config without "
                             "stage_layers")
        self.memory_limits_mb = dict(memory_limits_mb or {})
        self.plan_from_offers = plan_from_offers
        self.planned: OfferPlan | None = None
        self.planned_peers: list[str] = []
        if training_role not in ("training", "both"):
            raise ValueError(f"training peers join as training or both, not {training_role!r}")
        self.training_role = training_role
        if internet is None and (placement or relays):
            raise ValueError("placement and relays need an internet (net/netns.py)")
        self.config, self.config_path, self.replicas = config, config_path, replicas
        self.training = training
        self.adversaries = list(adversaries)
        self.internet, self.placement = internet, dict(placement or {})
        self.relay_hosts = list(relays)
        self.relay_addresses: list[str] = []
        self.dial_back: DialBackService | None = None
        self.logs = config.path / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.bootstrap: SwarmNode | None = None
        # The session of the manifest announced here until a coordinator announces its own: a
        # bench that drives the peers without one signs its routes with it.
        self.session = new_session()
        self.children: dict[str, Child] = {}
        self.sockets: set[str] = set()
        self._sockets_lock = threading.Lock()  # the report readers add to them

    def start(self, on_ready: Callable[[Child], None] = lambda child: None) -> list[str]:
        """A bootstrap DHT node in this process, under the run owner's key (the coordinator runs
        on it), then every peer; `on_ready` hears of each peer as it becomes ready (loading a
        stage takes a while). The owner's manifest is announced first: each peer waits for it,
        and the training peers, whose keys are made here, are admitted."""
        self.bootstrap = SwarmNode.start("bootstrap", [], link_profile(self.config),
                                         TensorLimits(), network=self._coordinator_network(),
                                         identity=owner_identity(self.config.path))
        addresses = self.bootstrap.addresses()
        if self.internet is not None:
            self.dial_back = DialBackService(self.bootstrap)
        for index, host in enumerate(self.relay_hosts):
            relay = Child(f"relay{index}", ["relay", "--listen", self._listen(host),
                                             "--exit-with-parent", "--log-json",
                                             *(f"--initial-peers={a}" for a in addresses)],
                          self.logs / f"relay{index}.log")
            self.placement.setdefault(relay.name, host)
            self.children[relay.name] = relay
            self._spawn(relay)
            self._wait_ready(relay, timeout_s=60)
            self.relay_addresses += relay.info["addresses"]
        keys = self.config.path / "keys"
        trainers: list[str] = []  # they offer and start first when the stages are planned
        hostile_trainers = {stage for kind in self.adversaries if kind in TRAINING_ADVERSARIES
                            for stage in adversary_stages(kind, self.config.num_stages)}
        for stage in range(self.config.num_stages):
            # The first training peer of a stage trains; any others audit it (trust/audit.py).
            # Beside a hostile training peer two honest ones: a third settles a disagreement.
            peers = self.config.swarm.training_peers_per_stage
            if stage in hostile_trainers:
                peers = max(peers, 2)
            for index in range(peers if self.training else 0):
                name = f"train{stage}" + (f".{index}" if index else "")
                key = keys / f"{name}.key"
                admit(self.config.path, [Identity.from_file(key).peer_id])
                planned = "auto" if self.plan_from_offers else str(stage)
                trainers.append(name)
                self._add(name, ["join", "--stage", planned, "--role", self.training_role,
                                 "--checkpoint-dir", str(self._checkpoint_dir(name)),
                                 "--identity", str(key)],
                          addresses)
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
                name = f"adv-{kind}" + (f".{stage}" if stages else "")
                if kind in TRAINING_ADVERSARIES:  # an admitted training peer that lies
                    key = keys / f"{name}.key"
                    admit(self.config.path, [Identity.from_file(key).peer_id])
                    role = ["training", "--checkpoint-dir", str(self._checkpoint_dir(name)),
                            "--identity", str(key)]
                else:
                    role = ["inference", "--collusion-dir", str(collusion)]
                self._add(name, ["join", "--stage", str(stage), "--adversary", kind, "--role",
                                 *role], addresses)
        peers = [child for child in self.children.values() if child.process is None]
        if self.plan_from_offers:  # the training peers offer while they wait for the plan
            for name in trainers:
                self._spawn(self.children[name])
            self._plan()
        # Until the coordinator announces it with its roster, this does (it expires unless
        # renewed, and loading the peers may take minutes).
        announced = threading.Event()
        renewer = threading.Thread(target=self._announce_run, args=(announced,),
                                   name="announce-run", daemon=True)
        renewer.start()
        try:
            for child in peers:
                if child.process is None:
                    self._spawn(child)
            for child in peers:
                self._wait_ready(child, timeout_s=300)
                on_ready(child)
        finally:
            announced.set()
            renewer.join()
        return addresses

    def _plan(self) -> None:
        """Stage plan from the training peers' offers; `config` (and its file) become the
        planned one."""
        assert self.bootstrap is not None
        planned = planned_run(self.bootstrap, self.config, Console(stderr=True), wait_s=300)
        self.config, self.planned_peers, self.planned = planned.config, planned.peers, \
            planned.made
        self.config_path.write_text(self.config.model_dump_json())

    def _announce_run(self, stop: threading.Event) -> None:
        assert self.bootstrap is not None
        manifest = run_manifest(self.config, roster=[], session=self.session,
                                planned=self.planned_peers)
        every_s = self.config.swarm.announce_every_s
        while True:
            try:
                publish_manifest(self.bootstrap, manifest, 5 * every_s)
            except Exception as error:  # noqa: BLE001 - the next round retries
                log.warning("announcing the run failed: %s", error)
            if stop.wait(every_s):
                return

    def _add(self, name: str, args: list[str], addresses: list[str]) -> None:
        assert self.bootstrap is not None
        full = [*args, "--config", str(self.config_path), "--owner", self.bootstrap.peer_id,
                "--name", name, "--exit-with-parent", "--log-json"]
        if name in self.memory_limits_mb:  # its own cap, which it offers as its memory
            full += ["--set", f"host.memory_limit_mb={self.memory_limits_mb[name]}"]
        for address in addresses:
            full += ["--initial-peers", address]
        if self.internet is not None:
            full += ["--listen", self._listen(self._host(name)), "--reachability", "auto"]
            for relay in [*self.relay_addresses, *addresses]:
                full += ["--relay", relay]
        self.children[name] = Child(name, full, self.logs / f"{name}.log")

    def _checkpoint_dir(self, name: str) -> Path:
        """Where a training peer keeps its checkpoints: on one machine, the run folder's; on
        hosts of their own, a folder of the peer's (the coordinator fetches the shards of the
        release: release/shards.py)."""
        if self.internet is None:
            return self.config.path / "checkpoints"
        return self.config.path / "hosts" / name / "checkpoints"

    def _host(self, name: str) -> str:
        return self.placement.get(name, self.placement.get("coordinator", ""))

    def _listen(self, host: str) -> str:
        """A host's own address on a port of its daemon's choosing (not every interface: its
        loopback address would be given out, and mean another host's loopback elsewhere)."""
        assert self.internet is not None
        return f"/ip4/{self.internet.hosts[host].address}/tcp/0"

    def _coordinator_network(self) -> NetworkOptions:
        if self.internet is None:
            return LOOPBACK_ONLY
        return self.internet.node_options(self._host("coordinator"))

    def _spawn(self, child: Child) -> None:
        # On one machine every peer competes for the same cores, which separate machines would
        # not; the training chain is the critical path, so inference replicas yield to it.
        niceness = INFERENCE_NICENESS if "--role" in child.args and \
            child.args[child.args.index("--role") + 1] == "inference" else 0
        command = [sys.executable, "-m", "decentrl.cli", *child.args]
        if self.internet is not None:
            command = self.internet.command(self._host(child.name), command)
        limit_mb = self.memory_limits_mb.get(child.name, self.config.host.memory_limit_mb)
        if limit_mb and child.memory is None:
            child.memory = MemoryCgroup.create(child.name, limit_mb * MIB)
        memory = child.memory

        def before_exec() -> None:  # in the child: capped before it loads anything
            if memory is not None:
                memory.preexec()
            if niceness:
                yield_cpu(niceness)
        with child.log_path.open("a") as log_file:
            child.started(subprocess.Popen(
                command, stdout=subprocess.PIPE,
                stderr=log_file, text=True, start_new_session=True,
                preexec_fn=before_exec if memory is not None or niceness else None))

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
                info = self._take_report(child, line)  # sockets cleaned up even if it fails later
                if info.get("ready") == READY:
                    child.info["ready_after_s"] = time.monotonic() - child.spawned_at
                    threading.Thread(target=self._read_reports, args=(child, child.process),
                                     name=f"reports-{child.name}", daemon=True).start()
                    return
            else:
                said.append(line.strip())
        raise TimeoutError(f"{child.name} was not ready within {timeout_s:.0f}s")

    def _take_report(self, child: Child, line: str) -> dict[str, Any]:
        info = json.loads(line)
        sockets = info.get("sockets", [])
        with self._sockets_lock:  # every socket any of its daemons had, removed when it goes
            child.info.update({**info, "sockets": [*child.info.get("sockets", []), *sockets]})
            self.sockets.update(sockets)
        return info

    def _read_reports(self, child: Child, process: subprocess.Popen[str]) -> None:
        """A ready peer's later reports: the sockets of each daemon a key-rotating adversary
        starts (the one before is shut down by the peer itself), so that a SIGKILL still leaves
        none behind. Until `process` ends; a restarted child has a reader of its own."""
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("{") and child.process is process:
                try:
                    self._take_report(child, line)
                except json.JSONDecodeError:
                    log.warning("%s: unreadable report %r", child.name, line[:200])

    def layout(self) -> list[str]:
        return [self.describe(child) for child in self.children.values()]

    def describe(self, child: Child) -> str:
        """A ready peer: its stage, layers, role and process id; on hosts of their own, where
        it sits, how others reach it, and how long it took to join."""
        text = (f"{child.name}: stage {child.info.get('stage')} layers "
                f"{child.info.get('layers')} ({child.info.get('role')}, pid "
                f"{child.process.pid if child.process else '-'})")
        if self.internet is None:
            return text
        host = self.internet.hosts[self._host(child.name)]
        where = f"home {host.home}, behind NAT" if host.behind_nat else "public segment"
        return (f"{text} on {host.name} ({where}); {child.info.get('reachability', '-')}; "
                f"ready {child.info.get('ready_after_s', 0):.0f}s after it started")

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
              on_event: Callable[[str, ChaosAction, str], None]) -> None:
        """Kill and restart a random peer `every_s` seconds after the last one is back, until
        `stop` is set; `on_event(peer, action, detail)` hears each kill ("killed") and its end
        ("back", or "not back" with the error)."""
        rng = random.Random(seed)
        while not stop.wait(every_s):
            name = rng.choice(sorted(self.children))
            on_event(name, "killed", "")
            try:
                self.restart(name)
                on_event(name, "back", "")
            except (RuntimeError, TimeoutError) as error:
                if not stop.is_set():  # at the end, shutting the swarm down stops a restart
                    on_event(name, "not back", str(error))

    def _remove_sockets(self, child: Child) -> None:
        with self._sockets_lock:
            paths = list(child.info.get("sockets", []))
            self.sockets.difference_update(paths)
        for path in paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

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
            if child.memory is not None:
                child.memory.remove()
        if self.bootstrap is not None:
            if self.dial_back is not None:
                self.bootstrap.run(self.dial_back.close(), timeout=30)
            self.bootstrap.shutdown()
