"""The `decentrl` command line: demo, train, coordinate, join, eval, export, report, bench.

Every failure a user can cause (a bad argument, config, address or folder; a peer that is not
there) ends in one line on stderr that names the problem, and exit code 2; an unexpected error
ends in one line and exit code 1. The traceback goes to the run's JSON log, and to the terminal
with `decentrl --debug`."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar, cast

import typer
from rich.console import Console

from decentrl.config import load_config, parse_config
from decentrl.demo import DEMO_TASKS
from decentrl.observe.logs import configure_logging
from decentrl.observe.terminal import terminal_text

if TYPE_CHECKING:
    from decentrl.net.reach import NetworkOptions
    from decentrl.release.export import Weights

log = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reinforcement-learning post-training of language models on a swarm of "
                       "untrusted peers.")
console = Console()
# Options that more than one command takes.
ExitWithParent = Annotated[bool, typer.Option(
    "--exit-with-parent",
    help="Stop when the process that started this one exits (the local launcher uses it).")]
LogJson = Annotated[bool, typer.Option(
    "--log-json",
    help="Log JSON lines to stderr and print machine-readable events on stdout (the local "
         "launcher reads them).")]
Command = TypeVar("Command", bound=Callable[..., None])
# What a user's input or a user's swarm can cause: shown as one line with exit code 2. Anything
# else is a bug: one line too, exit code 1.
USER_ERRORS = (ValueError, OSError, RuntimeError, TimeoutError)
INTERRUPTED_EXIT = 130
# An error's message on the terminal: ours name every bad field of a config in a few lines.
ERROR_CHARS = 4000
debug_mode = False


@app.callback()
def options(
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the full traceback of an error instead of one line.")] = False,
) -> None:
    global debug_mode
    debug_mode = debug


def command(name: str | None = None, **settings: Any) -> Callable[[Command], Command]:
    """`app.command`, with every error of the command reported as one line (see the module's
    docstring) instead of a traceback."""
    def register(function: Command) -> Command:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                function(*args, **kwargs)
            except KeyboardInterrupt:
                Console(stderr=True).print("interrupted")
                raise typer.Exit(code=INTERRUPTED_EXIT) from None
            except (typer.Exit, typer.Abort):
                raise
            except Exception as error:
                if debug_mode:
                    raise
                # INFO: the terminal's handler shows warnings and up, so the traceback reaches
                # the JSON log (where one is configured) and not the screen.
                log.info("%s failed", function.__name__, exc_info=error)
                if isinstance(error, USER_ERRORS):
                    fail(str(error) or type(error).__name__)
                fail(f"unexpected {type(error).__name__}: {error} (a bug; `decentrl --debug` "
                     "shows where)", code=1)

        # Typer keeps a docstring's line breaks, which land mid-sentence at other widths.
        paragraphs = inspect.cleandoc(function.__doc__ or "").split("\n\n")
        settings.setdefault("help", "\n\n".join(" ".join(p.split()) for p in paragraphs))
        app.command(name, **settings)(run)
        return function

    return register


def fail(message: str, code: int = 2) -> None:
    # stderr: stdout is data for whoever started a peer (its ready line). The message may quote a
    # peer (a refusal, a config from the DHT): inert, bounded, its lines kept.
    Console(stderr=True, soft_wrap=True).print(
        f"[red]error:[/] {terminal_text(message, ERROR_CHARS, multiline=True)}", highlight=False)
    raise typer.Exit(code=code)


@command()
def demo(
    name: Annotated[str, typer.Option(help="The run's name: its folder under runs/.")] = "demo",
    budget: Annotated[Optional[float], typer.Option(  # noqa: UP007
        help="Seconds of training, after which the run evaluates and exports (default: the "
             "task's demo budget, 720 for sums, 2700 for the agentic tasks, whose budget holds "
             "a supervised warm-up too).")] = None,
    chaos: Annotated[bool, typer.Option(
        "--chaos", help="Kill a random peer and restart it every few minutes while the run "
                        "goes on.")] = False,
    chaos_every: Annotated[float, typer.Option(help="Seconds between two chaos kills.")] = 120,
    local: Annotated[bool, typer.Option(
        "--local", help="Run every stage in this one process, with no network, instead of a "
                        "swarm of peers.")] = False,
    fresh: Annotated[bool, typer.Option(help="Delete an earlier run of this name first (only a "
                                             "folder that holds a run).")] = True,
    adversaries: Annotated[bool, typer.Option(
        "--adversaries",
        help="Add one hostile peer of every inference, judging and identity kind beside the "
             "honest ones, to watch the swarm catch them.")] = False,
    task: Annotated[str, typer.Option(
        help=f"What to post-train on: {' or '.join(DEMO_TASKS)} (word problems solved in "
             "episodes with a python tool).")] = "sums",
    verify_fraction: Annotated[Optional[float], typer.Option(  # noqa: UP007
        help="Share of rollout groups spot-checked (trust.verify_fraction; 1 checks every "
             "group).")] = None,
    netns: Annotated[bool, typer.Option(
        "--netns",
        help="Put every process on a host of its own, built from Linux network namespaces: "
             "the coordinator and a relay on a public segment, four of the six peers behind "
             "two home NAT routers (needs root; nothing leaves this machine).")] = False,
) -> None:
    """Post-train SmolLM2-135M-Instruct over a swarm on this machine.

    The swarm is a coordinator plus 2 stages, each with 2 inference replicas and 1 training peer,
    talking over emulated WAN links on loopback. It trains on sums or on tool-using word-problem
    episodes, reports held-out accuracy (or episode success) before and after, and exports the
    model."""
    from decentrl.demo import (
        ADVERSARIES_ANNOUNCE_EVERY_S,
        demo_config,
        fresh_run_folder,
        run_local,
        run_swarm_demo,
    )

    if local and netns:
        fail("--local runs every stage in one process; --netns needs a swarm: pick one")
    if netns:
        from decentrl.net.netns import NetnsUnavailable, check_privileges
        try:
            check_privileges()
        except NetnsUnavailable as error:
            fail(f"--netns: {error}")
    data = demo_config(task)
    data["name"] = name
    if budget is not None:
        data["train"]["time_budget_s"] = budget
    if verify_fraction is not None:
        data.setdefault("trust", {})["verify_fraction"] = verify_fraction
    if adversaries:
        data["swarm"]["announce_every_s"] = ADVERSARIES_ANNOUNCE_EVERY_S
    config = parse_config(data)
    if fresh:
        fresh_run_folder(config, console)
    if local:
        run_local(config, console)
    else:
        exit_on_sigterm()
        run_swarm_demo(config, console, chaos_every if chaos else None, adversaries, netns)


@command()
def train(config: Annotated[Path, typer.Option(
        "--config", help="The run's TOML file (examples/sums.toml is one).")]) -> None:
    """Run a post-training job in this one process, as a TOML config describes it.

    A run that stopped resumes from its last checkpoint."""
    from decentrl.demo import run_local

    run_local(load_config(config), console)


def exit_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so `finally` blocks stop what it started."""
    import signal

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def join_command(run: str, owner: str, addresses: Sequence[str]) -> str:
    """The command a volunteer types to join `run`, owned by the peer id `owner`."""
    return " ".join(["decentrl join", f"--run {run}", f"--owner {owner}", "--stage auto",
                     *(f"--initial-peers {address}" for address in addresses)])


@command()
def coordinate(
    config: Annotated[Path, typer.Option("--config", help="The run's TOML file.")],
    initial_peers: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The multiaddr of a peer already in the swarm, repeatable. Without one, this "
             "node starts the swarm and others join it.")] = None,
    wait: Annotated[float, typer.Option(
        help="Seconds to wait for every stage to have an inference replica and a training "
             "peer.")] = 600,
    admit: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The peer id of a training peer to admit, repeatable (it prints its id when it "
             "starts). Admitted ids are kept in RUN/admitted.txt; edit it to admit more while "
             "the run goes on.")] = None,
    listen: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="Where to listen, repeatable, like /ip4/0.0.0.0/tcp/31337 (open that TCP port to "
             "the internet). Default: loopback only, for a swarm on this machine. Listening "
             "elsewhere, the coordinator also relays for peers behind NAT and dials joining "
             "peers back to tell them whether others can reach them.")] = None,
    announce: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="The address to give peers instead of the listen one, repeatable: the host's "
             "public address, like /ip4/203.0.113.5/tcp/31337.")] = None,
) -> None:
    """Coordinate a swarm run.

    The coordinator schedules prompts, routes generation through inference peers, checks and
    stores the rollouts, trains the pipeline of training peers, evaluates and checkpoints. It
    runs under the run's key (RUN/keys/owner.key, made on the first start): peers obey it alone.
    It prints the command that volunteers run to join."""
    from decentrl.demo import before_after_table, release
    from decentrl.net.dialback import DialBackService
    from decentrl.net.node import SwarmNode
    from decentrl.net.reach import server_options
    from decentrl.net.wire import TensorLimits
    from decentrl.swarm.coordinate import swarm_run
    from decentrl.swarm.launch import RUN_END_LINGER_S, link_profile
    from decentrl.swarm.manifest import admit as admit_peers
    from decentrl.swarm.manifest import admitted_peers, announce_run_end, owner_identity

    exit_on_sigterm()
    run_config = load_config(config)
    network = network_options(lambda: server_options(listen or [], announce or []))
    admit_peers(run_config.path, admit or [])
    if not admitted_peers(run_config.path):
        console.print("no training peer is admitted yet: start each with decentrl join --role "
                      "training --identity FILE, then admit the peer id it prints (--admit ID, "
                      f"or a line in {run_config.path / 'admitted.txt'})", highlight=False)
    configure_logging("coordinator", json_file=run_config.path / "logs" / "coordinator.jsonl")
    node = SwarmNode.start("coordinator", initial_peers or [], link_profile(run_config),
                           TensorLimits(), network=network,
                           identity=owner_identity(run_config.path))
    dial_back = DialBackService(node) if network.reachability != "loopback" else None
    coordinator = None
    try:
        coordinator = swarm_run(run_config, node, console)  # checks the whole config
        joining = join_command(run_config.name, node.peer_id, node.addresses())
        (run_config.path / "join.txt").write_text(joining + "\n")
        console.print("peers join with this command (a training peer adds --role training "
                      "--identity KEY_FILE --checkpoint-dir DIR, and waits to be admitted; it is "
                      f"also in {run_config.path / 'join.txt'}):", highlight=False)
        # One line, never wrapped: a terminal that wraps it copies a broken address.
        console.print(joining, soft_wrap=True, highlight=False, markup=False)
        summary = coordinator.run(wait_s=wait)
        console.print(f"{summary.steps} steps; after: pass@1 {summary.after.pass1.as_percent()}")
        # Its peers stop (those of this session: net/session.py).
        announce_run_end(node, run_config.name, summary.steps,
                         coordinator.backend.manifest.session)
        ended_at = time.monotonic()
        if summary.before is not None:
            console.print(before_after_table(summary))
        model_dir, report_path = release(run_config, console)
        console.print(f"model: {model_dir}\nreport: {report_path}", highlight=False)
        linger_s = RUN_END_LINGER_S - (time.monotonic() - ended_at)
        if linger_s > 0:
            console.print(f"keeping the run's end announced {linger_s:.0f}s more, until every "
                          "peer has read it", highlight=False)
            time.sleep(linger_s)
    finally:
        if coordinator is not None:
            coordinator.close()
        if dial_back is not None:
            node.run(dial_back.close(), timeout=30)
        node.shutdown()


def network_options(make: Callable[[], NetworkOptions]) -> NetworkOptions:
    """`make()`, or exit with what is wrong with the network options given."""
    try:
        return make()
    except ValueError as error:
        fail(str(error))
        raise  # not reached: fail exits


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

    from decentrl.net.dialback import DialBackService
    from decentrl.net.link import LinkProfile
    from decentrl.net.node import SwarmNode, check_peer_addresses
    from decentrl.net.reach import server_options
    from decentrl.net.wire import TensorLimits
    from decentrl.swarm.launch import READY, print_json_line

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
        help="Where a training peer saves its checkpoints and resumes from them.")] = None,
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
) -> None:
    """Serve one stage of a run's model (exactly its layers) until stopped.

    Behind a home router it needs no open port: it finds out whether others can dial it,
    and if not, takes a slot at a relay (the coordinator by default) and is reached through
    it."""
    import signal
    import threading

    import torch

    from decentrl.net.dialback import CheckersBusy
    from decentrl.net.identity import Identity
    from decentrl.net.node import check_peer_addresses
    from decentrl.net.protocol import Role
    from decentrl.net.reach import REACHABILITIES, Reachability, peer_options
    from decentrl.swarm.adversary import ADVERSARIES
    from decentrl.swarm.launch import join as join_swarm
    from decentrl.swarm.launch import print_json_line
    from decentrl.swarm.manifest import check_peer_id

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
    run_config = load_config(config) if config is not None else None
    if run_config is not None and stage != "auto" and int(stage) >= run_config.num_stages:
        fail(f"--stage {stage}: run {run_config.name!r} has stages 0 to "
             f"{run_config.num_stages - 1}")
    torch.set_num_threads(run_config.threads if run_config and run_config.threads else 1)
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set())
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        join_swarm(run_config, run, owner, None if stage == "auto" else int(stage),
                   cast(Role, role), initial_peers, checkpoint_dir, name, stop, exit_with_parent,
                   adversary, collusion_dir,
                   report=print_json_line if log_json else print_join_event,
                   console=Console(stderr=True), config_wait_s=wait, identity=key,
                   network=network, keep_serving=keep_serving)
    except CheckersBusy as error:
        fail(str(error))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """--option KEY=VALUE items: the value as JSON where it parses, else as a string."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--option {item!r} must look like KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@command("eval")
def eval_command(
    model: Annotated[str, typer.Option(
        help="An exported Hugging Face folder, or smollm2-135m-instruct for the base model.")],
    base: Annotated[Optional[str], typer.Option(  # noqa: UP007 - typer needs Optional
        help="The model before post-training: adds the changes against it, and the drift "
             "from it (KL divergence, perplexity) on a general prompt set.")] = None,
    task: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="Evaluate this task family only, such as sums, rg:chain_sum or an environment "
             "such as agentic-calculator. Without it: the suite of two-digit sums and sums of "
             "three terms and of three digits.")] = None,
    option: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="An option of --task as KEY=VALUE (the value in JSON), repeatable.")] = None,
    problems: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="Held-out problems per family (default: 100).")] = None,
    pass_k: Annotated[int, typer.Option(
        help="The k of the sampled pass@k; 1 evaluates greedily only.")] = 4,
    max_new_tokens: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="The completion budget per problem (default: each family's own).")] = None,
    batch_size: Annotated[int, typer.Option(help="Problems generated at once.")] = 64,
    num_stages: Annotated[int, typer.Option(
        help="Stages to cut the model into (the same answers; for testing the chain).")] = 1,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, fp32, bf16 or fp16.")] = "auto",
    seed: Annotated[int, typer.Option(help="The seed of the sampled completions.")] = 0,
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="Also write the result as JSON to this file.")] = None,
) -> None:
    """Measure held-out accuracy, before and after post-training.

    Greedy pass@1 and sampled pass@k, with 95% confidence intervals, on several task families;
    with --base, the changes and the drift from the base on general text."""
    from decentrl.demo import run_suite, suite_table
    from decentrl.evaluate.suite import DEFAULT_SUITE, Family, with_overrides

    if option and task is None:
        fail("--option needs --task (the default suite's families carry their own options)")
    if output is not None and not output.parent.is_dir():
        fail(f"--output {output}: folder {output.parent} does not exist")
    families = DEFAULT_SUITE if task is None else [Family(task, parse_options(option or []))]
    result = run_suite(console, model, base, with_overrides(families, problems, max_new_tokens),
                       pass_k=pass_k, batch_size=batch_size, num_stages=num_stages,
                       device=device, dtype=dtype, seed=seed)
    console.print(suite_table(result))
    console.print(f"evaluated in {result.seconds:.0f}s")
    if output is not None:
        output.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {output}")


@command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder, such as runs/demo.")],
    out_dir: Annotated[Path, typer.Argument(
        help="A new or empty folder for the Hugging Face model.")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    weights: Annotated[str, typer.Option(
        help="served: the weights the swarm's replicas served (they generated the rollouts and "
             "answered the evaluations); learner: the training peers' own (they differ with "
             "sparse updates).")] = "served",
    force: Annotated[bool, typer.Option(
        "--force",
        help="Replace an earlier export at OUT_DIR. Other files, a run folder or the run "
             "itself are never replaced.")] = False,
) -> None:
    """Export a run's model as a Hugging Face folder.

    Assembles the run's latest checkpoint (every stage's shard) into a folder that
    transformers.AutoModelForCausalLM loads, with a model card and checksums. Nothing is
    deleted, unless --force replaces an earlier export that nobody has added files to."""
    from decentrl.release.export import EXPORT_DTYPES, WEIGHTS, export_run

    chosen = {name: dtype_ for dtype_, name in EXPORT_DTYPES.items()}.get(dtype)
    if chosen is None:
        fail(f"--dtype must be one of {', '.join(EXPORT_DTYPES.values())}, got {dtype!r}")
        return
    if weights not in WEIGHTS:
        fail(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    folder = export_run(run_dir, out_dir, chosen, cast("Weights", weights), force=force)
    console.print(f"exported {run_dir} to {folder}")


@command()
def report(run_dir: Annotated[Path, typer.Argument(
        help="A run folder, such as runs/demo.")]) -> None:
    """Write a run's report: RUN_DIR/report/report.md with PNG plots.

    The report shows the evaluations before and after, the learning signals, staleness,
    throughput, the swarm's peers and traffic, and the verification events; the command prints
    its path."""
    from decentrl.observe.report import build_report

    typer.echo(build_report(run_dir))  # plain: a script may read the path


BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def benchmarks() -> dict[str, str]:
    """Each benchmark of the source checkout by name, with its docstring's summary line."""
    found = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem == "common":
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.replace("_", "-")] = docstring.partition("\n")[0]
    return found


def bench_help() -> str:
    if not BENCH_DIR.is_dir():
        return "Run a benchmark of the source checkout (not found here)."
    listing = "\n".join(f"- {name}: {summary}" for name, summary in benchmarks().items())
    return ("Run a benchmark of the source checkout; extra arguments go to it (decentrl bench "
            f"NAME -- --help lists them).\n\nThe benchmarks:\n\n\b\n{listing}")


@command(help=bench_help(),
         context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(
        help="The benchmark, as listed below.")]) -> None:
    if not BENCH_DIR.is_dir():
        fail(f"benchmarks live in the source checkout ({BENCH_DIR} is missing)")
    available = benchmarks()
    if name not in available:
        fail(f"unknown benchmark {name!r}; available: {', '.join(available)} "
             "(decentrl bench --help says what each measures)")
    path = BENCH_DIR / f"{name.replace('-', '_')}.py"
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)
    module.main(list(ctx.args))


if __name__ == "__main__":
    app()
