"""Starting peers: `join` (one stage peer in this process, until it is told to stop) and
`LocalSwarm` (the coordinator and every peer as separate processes on loopback, for the demo and
the multi-process tests). Each child runs in its own process group, so stopping it also stops its
p2pd daemon, and the unix sockets a killed daemon leaves behind are removed."""

from __future__ import annotations

import dataclasses
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
from decentrl.net.dialback import DialBackService, start_reachable
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.netns import Internet
from decentrl.net.node import LOOPBACK_ONLY, SwarmNode
from decentrl.net.protocol import PeerRecord, Role, layer_span, stage_key
from decentrl.net.reach import NetworkOptions
from decentrl.net.records import decode_records
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits, WireError
from decentrl.swarm.adversary import (
    ADVERSARIES,
    TRAINING_ADVERSARIES,
    adversary_stages,
    flood,
    hostile_peer,
    rotate_keys,
    submit_replays,
)
from decentrl.swarm.manifest import (
    RunEndWatch,
    accept_manifest,
    admit,
    check_peer_id,
    owner_identity,
    publish_manifest,
    run_manifest,
    wait_for_manifest,
)
from decentrl.swarm.peer import StagePeer

log = logging.getLogger(__name__)

READY = "DECENTRL-READY"
LOOKUP_TIMEOUT_S = 30.0
RUN_END_CHECK_S = 10.0
# How long an owner keeps serving after it said its run ended: relays and bootstrap nodes keep no
# run's records (net/dht_storage.py), and peers behind NAT store none, so once the owner leaves
# nobody may hold its `RunEnded` any more; every joined peer reads it within RUN_END_CHECK_S
# (plus a lookup), so three checks' worth covers a peer whose check failed once.
RUN_END_LINGER_S = 3 * RUN_END_CHECK_S
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


def choose_stage(node: SwarmNode, config: RunConfig, role: Role) -> int:
    """`--stage auto`: a training peer takes a stage without a ready one; an inference peer takes
    a stage with the fewest replicas. Each announcing peer counts once, whatever it claims: a
    replica that boasts of free sessions it does not have (measured on the earlier code, which
    summed claimed sessions: one such record sent 8 of 8 joiners to the other stage) weighs no
    more than any other. Ties are broken at random: peers started together see the same empty
    swarm, and would all take stage 0 otherwise."""
    served = []
    for stage in range(config.num_stages):
        found, skipped = decode_records(node.run(node.lookup(stage_key(config.name, stage)),
                                                 timeout=LOOKUP_TIMEOUT_S), PeerRecord, stage)
        if skipped:
            log.warning("stage %d: skipped %d malformed announcements", stage, skipped)
        records = list(found.values())
        if role == "training":
            served.append(sum(r.training_ready for r in records))
        else:
            served.append(sum(r.role != "training" for r in records))
    least = min(served)
    # Not the module's generator: whatever seeded it would seed every joining peer alike.
    return random.SystemRandom().choice([stage for stage, count in enumerate(served)
                                         if count == least])


def run_ended(node: SwarmNode, watch: RunEndWatch, console: Console,
              report: Callable[[dict[str, Any]], None]) -> bool:
    """Whether the owner ended the session this peer serves (said so on `console`); False when
    unsure. A `RunEnded` of another session is reported once (`run_end_ignored`)."""
    reported = len(watch.ignored)
    try:
        ended = watch.ended(node)
    except (WireError, TimeoutError, RuntimeError) as error:
        log.info("could not read whether run %s ended: %s", watch.run, error)
        return False
    for reason in watch.ignored[reported:]:
        log.warning("%s", reason)
        report({"run_end_ignored": reason})
    if ended is not None:
        console.print(f"run {watch.run!r} ended after {ended.steps} steps; stopping",
                      markup=False, highlight=False)
    return ended is not None


def print_json_line(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def join(config: RunConfig | None, run: str | None, owner: str, stage: int | None, role: Role,
         initial_peers: list[str], checkpoint_dir: Path | None, name: str,
         stop: threading.Event, exit_with_parent: bool = False, adversary: str | None = None,
         collusion_dir: Path | None = None, report: Callable[[dict[str, Any]], None] =
         print_json_line, console: Console | None = None, config_wait_s: float = 300,
         identity: Identity | None = None, network: NetworkOptions = LOOPBACK_ONLY,
         keep_serving: bool = False) -> None:
    """Run one stage peer of the run that `owner` (a peer id) owns until `stop` is set (or, with
    `exit_with_parent`, until the process that started it is gone: a launcher that dies must not
    leave peers behind). The peer waits for the owner's signed run manifest and serves with its
    config, or with `config` if that is the same (swarm/manifest.py). `report` gets its sockets
    first (whoever started it must be able to remove them if it dies), then, once it serves, a
    READY event: peer id, run, stage, layers ("0-14"), role, addresses. `adversary` makes it a
    hostile peer (swarm/adversary.py): a stage peer that lies, or a client that attacks.
    `console` shows the wait for the manifest. `identity`: the peer's key (a training peer keeps
    its admitted peer id across restarts); a fresh one by default. `network`: where it listens
    and how others reach it (net/reach.py); it finds out which way works and says so. When the
    owner says the run ended, the peer stops, unless `keep_serving`."""
    if config is None and run is None:
        raise ValueError("join needs --config or --run (to take the run owner's config)")
    check_peer_id(owner, "--owner")
    parent = os.getppid()
    profile = link_profile(config) if config is not None else LinkProfile()
    threads = config.threads if config is not None and config.threads else None
    identity = identity or Identity.generate()  # the same across a reachability restart
    console = console or Console(stderr=True)

    def start_node(options: NetworkOptions) -> SwarmNode:
        started = SwarmNode.start(name, initial_peers, profile, TensorLimits(), network=options,
                                  compute_threads=threads, identity=identity)
        report({"sockets": started.socket_paths()})
        return started

    node, reach = start_reachable(name, initial_peers, network, start_node)
    if network.reachability != "loopback":
        console.print(f"{name} is {reach.describe()}", markup=False, highlight=False,
                      soft_wrap=True)
        if not reach.reachable:
            log.warning("%s: no peer could dial this one; it serves what reaches it over its "
                        "own connections only", name)
    if role != "inference" and adversary is None:
        console.print(f"this training peer's id is {node.peer_id}: the run's operator admits "
                      "it (decentrl coordinate --admit ID, or a line in RUN/admitted.txt)",
                      markup=False, highlight=False, soft_wrap=True)
    try:
        manifest = wait_for_manifest(node, config.name if config is not None else str(run),
                                     owner, config_wait_s, stop, console)
        if manifest is None:
            return
        joined_by_name = config is None
        config = accept_manifest(manifest, config)
        if joined_by_name:  # its node started before it knew the run's link and threads
            node.configure(link_profile(config), config.threads)

        watch = RunEndWatch(config.name, owner, manifest.session)

        def until_stopped() -> None:
            checked = time.monotonic()
            while not stop.wait(1.0):
                if exit_with_parent and os.getppid() != parent:
                    log.warning("%s: the launcher is gone; stopping", name)
                    break
                if not keep_serving and time.monotonic() - checked > RUN_END_CHECK_S:
                    checked = time.monotonic()
                    if run_ended(node, watch, console, report):
                        break
            stop.set()

        ready = {"ready": READY, "name": name, "peer_id": node.peer_id, "run": config.name,
                 "addresses": node.addresses(), "reachability": reach.describe()
                 if network.reachability != "loopback" else "loopback",
                 "link": dataclasses.asdict(node.link_profile)}
        if adversary in ("replay", "flood"):
            report({**ready, "role": adversary})
            watcher = threading.Thread(target=until_stopped, daemon=True)
            watcher.start()
            attack = submit_replays if adversary == "replay" else flood
            attack(node, config, owner, stop)
            return
        chosen = stage if stage is not None else choose_stage(node, config, role)
        if adversary == "rotate-keys":
            report({**ready, "stage": chosen, "num_stages": config.num_stages, "role": role})
            watcher = threading.Thread(target=until_stopped, daemon=True)
            watcher.start()
            rotate_keys(config, chosen, node, lambda: SwarmNode.start(
                name, initial_peers, profile, TensorLimits(), compute_threads=threads),
                owner, name, stop, lambda fresh: report({"sockets": fresh.socket_paths()}))
            return
        if adversary is not None:
            peer = hostile_peer(config, chosen, node, owner, name, adversary, collusion_dir, role,
                                checkpoint_dir)
        else:
            peer = StagePeer(config, chosen, role, node, owner, checkpoint_dir, name)
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
    spawned_at: float = 0.0  # monotonic


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
                 relays: Sequence[str] = ()) -> None:
        """`training=False` starts inference replicas only (generation benchmarks).
        `adversaries` adds hostile peers (swarm/adversary.py) beside the honest ones."""
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
        # Until the coordinator announces it with its roster, this does (it expires unless
        # renewed, and loading the peers may take minutes).
        announced = threading.Event()
        renewer = threading.Thread(target=self._announce_run, args=(announced,),
                                   name="announce-run", daemon=True)
        renewer.start()
        keys = self.config.path / "keys"
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
                self._add(name, ["join", "--stage", str(stage), "--role", "training",
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
        try:
            for child in peers:
                self._spawn(child)
            for child in peers:
                self._wait_ready(child, timeout_s=300)
                on_ready(child)
        finally:
            announced.set()
            renewer.join()
        return addresses

    def _announce_run(self, stop: threading.Event) -> None:
        assert self.bootstrap is not None
        manifest = run_manifest(self.config, roster=[], session=new_session())
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
        with child.log_path.open("a") as log_file:
            child.process = subprocess.Popen(
                command, stdout=subprocess.PIPE,
                stderr=log_file, text=True, start_new_session=True,
                preexec_fn=(lambda: yield_cpu(niceness)) if niceness else None)
        child.info = {}
        child.spawned_at = time.monotonic()

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
        if self.bootstrap is not None:
            if self.dial_back is not None:
                self.bootstrap.run(self.dial_back.close(), timeout=30)
            self.bootstrap.shutdown()
