"""Starting one stage peer: `join` runs it in this process until it is told to stop. It finds
out how others can reach it (net/dialback.py), waits for the owner's signed run manifest, takes
its stage (`choose_stage` for `--stage auto`) and serves until the owner says the run ended."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from decentrl.config import HostConfig, RunConfig
from decentrl.coordinator.manifest import (
    RunEndWatch,
    accept_manifest,
    check_peer_id,
    check_stage_files,
    wait_for_manifest,
)
from decentrl.launch.adversary import (
    flood,
    hostile_peer,
    rotate_keys,
    submit_replays,
)
from decentrl.launch.offer import OfferAnnouncer, host_offer
from decentrl.net.dialback import start_reachable
from decentrl.net.identity import Identity
from decentrl.net.link import LinkProfile
from decentrl.net.node import LOOPBACK_ONLY, SwarmNode
from decentrl.net.protocol import PeerRecord, Role, layer_span, stage_key
from decentrl.net.reach import NetworkOptions
from decentrl.net.records import decode_records
from decentrl.net.wire import TensorLimits, WireError
from decentrl.stage.peer import StagePeer

log = logging.getLogger(__name__)

READY = "DECENTRL-READY"
LOOKUP_TIMEOUT_S = 30.0
RUN_END_CHECK_S = 10.0
# How often a waiting training peer renews its offer (a peer joining by the run's name knows no
# announce period yet: the default one).
ANNOUNCE_OFFER_S = 2.0
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
    """This host's link emulation (host.link), seeded by the run."""
    link = config.host.link
    return LinkProfile(rtt_ms=link.rtt_ms, jitter_ms=link.jitter_ms,
                       bandwidth_mbps=link.bandwidth_mbps, uplink_mbps=link.uplink_mbps,
                       loss=link.drop_probability, seed=config.seed)


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
         keep_serving: bool = False, host: HostConfig | None = None) -> None:
    """Run one stage peer of the run that `owner` (a peer id) owns until `stop` is set (or, with
    `exit_with_parent`, until the process that started it is gone: a launcher that dies must not
    leave peers behind). The peer waits for the owner's signed run manifest and serves with its
    config, or with `config` if that is the same (coordinator/manifest.py). `report` gets its
    sockets first (whoever started it must be able to remove them if it dies), then, once it serves,
    a READY event: peer id, run, stage, layers ("0-14"), role, addresses. `adversary` makes it a
    hostile peer (launch/adversary.py): a stage peer that lies, or a client that attacks.
    `console` shows the wait for the manifest. `identity`: the peer's key (a training peer keeps
    its admitted peer id across restarts); a fresh one by default. `network`: where it listens
    and how others reach it (net/reach.py); it finds out which way works and says so. When the
    owner says the run ended, the peer stops, unless `keep_serving`. `host`: this peer's own
    settings (device, dtype, threads, link emulation), which the run's do not cover; by default
    `config`'s, or the defaults when it joins by the run's name."""
    if config is None and run is None:
        raise ValueError("join needs --config or --run (to take the run owner's config)")
    check_peer_id(owner, "--owner")
    parent = os.getppid()
    profile = link_profile(config) if config is not None else LinkProfile()
    host = host or (config.host if config is not None else HostConfig())
    threads = host.threads or None
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
    run_name = config.name if config is not None else str(run)
    try:
        # A training peer offers its memory and speed while it waits: an owner that plans its
        # stages from its peers (coordinator/planning.py) waits for these offers first.
        offering = OfferAnnouncer(node, host_offer(run_name, role, host),
                                  ANNOUNCE_OFFER_S).start() \
            if role != "inference" and adversary is None else None
        try:
            manifest = wait_for_manifest(node, run_name, owner, config_wait_s, stop, console)
        finally:
            if offering is not None:
                offering.stop()
        if manifest is None:
            return
        joined_by_name = config is None
        config = accept_manifest(manifest, config).with_host(host)
        if joined_by_name:  # its node started before it knew the run's seed, which links use
            node.configure(link_profile(config), threads)

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
        planned = manifest.planned.index(node.peer_id) \
            if node.peer_id in manifest.planned[:config.num_stages] else None
        if stage is not None and planned is not None and stage != planned:
            raise ValueError(f"--stage {stage}, but the run's owner planned stage {planned} for "
                             "this peer (join with --stage auto)")
        chosen = stage if stage is not None else planned if planned is not None \
            else choose_stage(node, config, role)
        check_stage_files(manifest, config, chosen)
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
