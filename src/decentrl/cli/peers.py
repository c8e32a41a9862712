"""The commands that serve a swarm: relay and join, and what a joined peer says of itself."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional, cast

import typer
from rich.console import Console

from decentrl.cli.common import (
    ExitWithParent,
    LogJson,
    command,
    console,
    fail,
    network_options,
)
from decentrl.config import load_config, parse_host
from decentrl.observe.logs import configure_logging
from decentrl.observe.terminal import terminal_text


@command()
def relay(
    listen: Annotated[list[str], typer.Option(
        help="Where to listen, repeatable, like /ip4/0.0.0.0/tcp/31338 (a port open to the "
             "internet).")],
    initial_peers: Annotated[list[str], typer.Option(
        help="The multiaddr of a peer in the swarm (the coordinator prints it), repeatable.")],
    announce: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The address to give peers instead of the listen one, repeatable.")] = None,
    exit_with_parent: ExitWithParent = False,
    log_json: LogJson = False,
) -> None:
    """Relay for peers behind NAT, until stopped (a public host with spare bandwidth).

    It serves no layers: peers that nobody can dial take a slot here and are reached through
    it (libp2p circuit relay v2), and joining peers ask it whether others can dial them. Give
    its address to volunteers with --relay."""
    import os
    import signal
    import threading

    from decentrl.launch.join import READY, print_json_line
    from decentrl.net.dialback import DialBackService
    from decentrl.net.link import LinkProfile
    from decentrl.net.node import SwarmNode, check_peer_addresses
    from decentrl.net.reach import server_options
    from decentrl.net.wire import TensorLimits

    configure_logging("relay", json_stderr=log_json)
    check_peer_addresses(initial_peers)
    network = network_options(lambda: server_options(listen, announce or []))
    if network.reachability == "loopback":
        fail("a relay listens on an address other peers can dial, not on loopback")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    parent = os.getppid()
    node = SwarmNode.start("relay", initial_peers, LinkProfile(), TensorLimits(),
                           network=network)
    dial_back = DialBackService(node)
    try:
        if log_json:
            print_json_line({"sockets": node.socket_paths() + dial_back.socket_paths()})
            print_json_line({"ready": READY, "name": "relay", "peer_id": node.peer_id,
                             "addresses": node.addresses(), "role": "relay"})
        else:
            for address in node.addresses():
                console.print(f"relaying at {address}", soft_wrap=True, highlight=False)
            console.print("peers behind NAT use it with: decentrl join ... --relay ADDRESS "
                          "(one of the above); serving until Ctrl-C", highlight=False)
        while not stop.wait(1.0):
            if exit_with_parent and os.getppid() != parent:
                break
    finally:
        node.run(dial_back.close(), timeout=30)
        node.shutdown()


def reachability(address: str) -> str:
    """Who can dial `address`, from its IP alone."""
    import ipaddress

    parts = address.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return "reachable by name"
    ip = ipaddress.ip_address(parts[2])
    if ip.is_loopback:
        return "this machine only"
    if ip.is_private or ip.is_link_local:
        return "this local network only"
    return "directly"


def print_join_event(event: dict[str, Any]) -> None:
    """A joined peer's summary, in words (the launcher reads the same events as JSON lines)."""
    if "ready" not in event:
        return  # its sockets: for a launcher that must clean up after it
    role = event["role"]
    where = (f"stage {event['stage']} of {event['num_stages']}, layers {event['layers']}, {role}"
             if "stage" in event else f"hostile client ({role})")
    console.print(f"joined run {terminal_text(event['run'])} as {event['name']}: {where}",
                  highlight=False)
    console.print(f"  peer id {event['peer_id']}", highlight=False, soft_wrap=True)
    for address in event["addresses"]:
        console.print(f"  listening on {address} (reachable from {reachability(address)})",
                      highlight=False, soft_wrap=True)
    console.print("serving until Ctrl-C")


@command()
def join(
    initial_peers: Annotated[list[str], typer.Option(
        help="The multiaddr of a peer in the swarm (the coordinator prints it), repeatable.")],
    owner: Annotated[str, typer.Option(
        help="The peer id of the run's owner (its coordinator, in the join command it "
             "prints): the peer takes the run's config from it and obeys it alone.")],
    stage: Annotated[str, typer.Option(
        help="The stage to serve: its index, or auto for the stage that needs a peer most.")]
    = "auto",
    role: Annotated[str, typer.Option(
        help="inference (generate rollouts), training (train the stage) or both.")]
    = "inference",
    config: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        "--config", help="The run's config file. Without it, the peer takes the owner's "
                         "through the swarm; with it, the owner's must be the same.")] = None,
    run: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="The run's name, when --config is not given.")] = None,
    wait: Annotated[float, typer.Option(
        help="Seconds to wait for the run owner's manifest.")] = 300,
    identity: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="A key file that keeps this peer's id across restarts (made if missing, mode "
             "600). A training peer needs one: the run's operator admits its peer id.")] = None,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="Where a training peer saves its checkpoints and resumes from them (default: "
             "host.checkpoint_dir).")] = None,
    name: Annotated[str, typer.Option(help="A name for logs and the peer table.")] = "peer",
    exit_with_parent: ExitWithParent = False,
    adversary: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="Run a hostile peer instead, for trust tests and demos: random-tokens, "
             "forge-logprobs, inject-answers, corrupt-activations, corrupt-unopened, "
             "malformed-activations, replay or flood.")] = None,
    collusion_dir: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="A folder that an inject-answers pair shares.")] = None,
    log_json: LogJson = False,
    listen: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="Where to listen, repeatable. Default: loopback when every initial peer is on "
             "this machine, else every interface on a random port.")] = None,
    announce: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The address to give peers instead of the listen one, repeatable (a host with a "
             "public address, or a forwarded port).")] = None,
    relay: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The full multiaddr of a relay to use if others cannot dial this peer, "
             "repeatable. Default: the initial peers.")] = None,
    reachability: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="auto (ask a peer to dial this one back: directly reachable, or else through "
             "relays), direct, relayed, or loopback. Default: loopback when every initial "
             "peer is on this machine, else auto.")] = None,
    keep_serving: Annotated[bool, typer.Option(
        "--keep-serving",
        help="Go on serving after the run's owner says the run ended (by default the peer "
             "stops then).")] = False,
    settings: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        "--set", metavar="host.FIELD=VALUE",
        help="This machine's own setting, repeatable, which the run's owner does not decide "
             "(--set host.device=cuda, --set host.dtype=bf16, --set host.threads=8); with "
             "--config, any field of it. docs/config.md lists them.")] = None,
) -> None:
    """Serve one stage of a run's model (exactly its layers) until stopped.

    Behind a home router it needs no open port: it finds out whether others can dial it,
    and if not, takes a slot at a relay (the coordinator by default) and is reached through
    it. Its device, dtype, threads and link emulation are its own (--set host.FIELD=VALUE):
    peers on different hardware serve the same run."""
    import signal
    import threading

    import torch

    from decentrl.coordinator.manifest import check_peer_id
    from decentrl.launch.adversary import ADVERSARIES
    from decentrl.launch.join import join as join_swarm
    from decentrl.launch.join import print_json_line
    from decentrl.net.dialback import CheckersBusy
    from decentrl.net.identity import Identity
    from decentrl.net.node import check_peer_addresses
    from decentrl.net.protocol import Role
    from decentrl.net.reach import REACHABILITIES, Reachability, peer_options

    configure_logging(name, json_stderr=log_json)
    if role not in ("inference", "training", "both"):
        fail(f"--role must be inference, training or both, got {role!r}")
    if stage != "auto" and not stage.isdigit():
        fail(f"--stage must be a stage index or auto, got {stage!r}")
    if adversary is not None and adversary not in ADVERSARIES:
        fail(f"--adversary must be one of {', '.join(ADVERSARIES)}, got {adversary!r}")
    if config is None and run is None:
        fail("join needs --run (the run's name, from the coordinator's join command) or "
             "--config")
    check_peer_addresses(initial_peers)
    if reachability is not None and reachability not in REACHABILITIES:
        fail(f"--reachability must be one of {', '.join(REACHABILITIES)}, got {reachability!r}")
    network = network_options(lambda: peer_options(
        initial_peers, listen or [], announce or [], relay or [],
        cast(Reachability, reachability) if reachability else None))
    try:
        check_peer_id(owner, "--owner")
        key = Identity.from_file(identity) if identity is not None else None
    except (ValueError, PermissionError) as error:
        fail(str(error))
    if role != "inference" and key is None:
        fail("a training peer needs --identity FILE: the run's operator admits its peer id, "
             "which must stay the same when it restarts")
    run_config = load_config(config, settings or []) if config is not None else None
    host = run_config.host if run_config is not None else parse_host(settings or [])
    if run_config is not None and stage != "auto" and int(stage) >= run_config.num_stages:
        fail(f"--stage {stage}: run {run_config.name!r} has stages 0 to "
             f"{run_config.num_stages - 1}")
    torch.set_num_threads(host.threads or 1)
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set())
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        join_swarm(run_config, run, owner, None if stage == "auto" else int(stage),
                   cast(Role, role), initial_peers, checkpoint_dir or host.checkpoint_dir, name,
                   stop, exit_with_parent,
                   adversary, collusion_dir,
                   report=print_json_line if log_json else print_join_event,
                   console=Console(stderr=True), config_wait_s=wait, identity=key,
                   network=network, keep_serving=keep_serving, host=host)
    except CheckersBusy as error:
        fail(str(error))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
