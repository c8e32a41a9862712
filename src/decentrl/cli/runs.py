"""The commands that run a run: demo, train and coordinate."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from decentrl.cli.common import (
    Settings,
    command,
    console,
    exit_on_sigterm,
    fail,
    network_options,
)
from decentrl.config import RunConfig, load_config, parse_config
from decentrl.demo import DEMO_TASKS
from decentrl.observe.logs import configure_logging


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
             "honest ones, to watch the swarm catch them (with one honest inference replica "
             "per stage, so it fits in 24 GB).")] = False,
    task: Annotated[str, typer.Option(
        help=f"What to post-train on: {' or '.join(DEMO_TASKS)} (agentic: word problems "
             "solved in episodes with a python tool; dataset: the word problems of "
             "examples/datasets/word_problems.jsonl as plain prompts).")] = "sums",
    verify_fraction: Annotated[Optional[float], typer.Option(  # noqa: UP007
        help="Share of rollout groups spot-checked (trust.verify_fraction; 1 checks every "
             "group).")] = None,
    netns: Annotated[bool, typer.Option(
        "--netns",
        help="Put every process on a host of its own, built from Linux network namespaces: "
             "the coordinator and a relay on a public segment, four of the six peers behind "
             "two home NAT routers (needs root; nothing leaves this machine).")] = False,
    settings: Settings = None,
) -> None:
    """Post-train SmolLM2-135M-Instruct over a swarm on this machine.

    The swarm is a coordinator plus 2 stages, each with 2 inference replicas and 1 training peer,
    talking over emulated WAN links on loopback. It trains on sums or on tool-using word-problem
    episodes, reports held-out accuracy (or episode success) before and after, and exports the
    model. Its recipe for each task is a TOML file under examples/ (demo.toml for sums)."""
    from decentrl.demo import (
        ADVERSARIES_ANNOUNCE_EVERY_S,
        ADVERSARIES_HONEST_REPLICAS,
        ADVERSARIES_KEPT_ACTIVATIONS_MB,
        ADVERSARIES_REVEAL_WINDOW_S,
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
    # The options first, then --set: what a user spells out field by field wins.
    changes = [f"train.time_budget_s={budget!r}"] if budget is not None else []
    if verify_fraction is not None:
        changes.append(f"trust.verify_fraction={verify_fraction!r}")
    if adversaries:
        changes += [f"swarm.announce_every_s={ADVERSARIES_ANNOUNCE_EVERY_S!r}",
                    f"swarm.inference_replicas={ADVERSARIES_HONEST_REPLICAS!r}",
                    f"trust.reveal_window_s={ADVERSARIES_REVEAL_WINDOW_S!r}",
                    f"swarm.kept_activations_mb={ADVERSARIES_KEPT_ACTIVATIONS_MB!r}"]
    config = parse_config({**demo_config(task), "name": name}, [*changes, *(settings or [])])
    if fresh:
        fresh_run_folder(config, console)
    if local:
        run_local(config, console)
    else:
        exit_on_sigterm()
        run_swarm_demo(config, console, chaos_every if chaos else None, adversaries, netns)


@command()
def train(config: Annotated[Path, typer.Option(
        "--config", help="The run's TOML file (examples/sums.toml is one).")],
          settings: Settings = None) -> None:
    """Run a post-training job in this one process, as a TOML config describes it.

    A run that stopped resumes from its last checkpoint."""
    from decentrl.demo import run_local

    run_local(load_config(config, settings or []), console)


def join_command(run: str, owner: str, addresses: Sequence[str]) -> str:
    """The command a volunteer types to join `run`, owned by the peer id `owner`."""
    return " ".join(["decentrl join", f"--run {run}", f"--owner {owner}", "--stage auto",
                     *(f"--initial-peers {address}" for address in addresses)])


def say_how_to_join(config: RunConfig, owner: str, addresses: Sequence[str]) -> None:
    """Print the join command (and keep it in RUN/join.txt)."""
    joining = join_command(config.name, owner, addresses)
    (config.path / "join.txt").write_text(joining + "\n")
    console.print("peers join with this command (a training peer adds --role training "
                  "--identity KEY_FILE --checkpoint-dir DIR, and waits to be admitted; it is "
                  f"also in {config.path / 'join.txt'}):", highlight=False)
    # One line, never wrapped: a terminal that wraps it copies a broken address.
    console.print(joining, soft_wrap=True, highlight=False, markup=False)


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
    plan_from_offers: Annotated[bool, typer.Option(
        "--plan-from-offers",
        help="Plan how many layers each stage gets from the admitted training peers' offers "
             "(their memory and measured speed, announced while they wait) before the run "
             "starts; the config leaves stage_layers out. The plan is kept in "
             "RUN/stage_plan.json for a resumed run.")] = False,
    settings: Settings = None,
) -> None:
    """Coordinate a swarm run.

    The coordinator schedules prompts, routes generation through inference peers, checks and
    stores the rollouts, trains the pipeline of training peers, evaluates and checkpoints. It
    runs under the run's key (RUN/keys/owner.key, made on the first start): peers obey it alone.
    It prints the command that volunteers run to join."""
    from decentrl.coordinator.manifest import admit as admit_peers
    from decentrl.coordinator.manifest import admitted_peers, announce_run_end, owner_identity
    from decentrl.coordinator.planning import planned_run
    from decentrl.coordinator.swarm_backend import swarm_run
    from decentrl.demo import before_after_table, release
    from decentrl.launch.join import RUN_END_LINGER_S, link_profile
    from decentrl.net.dialback import DialBackService
    from decentrl.net.node import SwarmNode
    from decentrl.net.reach import server_options
    from decentrl.net.wire import TensorLimits

    exit_on_sigterm()
    run_config = load_config(config, settings or [])
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
        planned: list[str] = []
        if plan_from_offers:  # the training peers offer while they wait for the manifest
            say_how_to_join(run_config, node.peer_id, node.addresses())
            try:
                made = planned_run(node, run_config, console, wait)
            except (ValueError, TimeoutError) as error:
                fail(f"planning the stages from offers: {error}")
                return
            run_config, planned = made.config, made.peers
        coordinator = swarm_run(run_config, node, console, planned=planned)  # checks it all
        if not plan_from_offers:
            say_how_to_join(run_config, node.peer_id, node.addresses())
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


@command()
def plan(
    peers: Annotated[list[str], typer.Argument(
        help="One MEMORY_GIB:SPEED per stage, in order: the memory its peers give the weights, "
             "and their speed in any unit that is the same for all (announced tokens/s, or 1 "
             "for alike machines).")],
    model: Annotated[str, typer.Option(help="The model: a name, Hugging Face folder or .gguf "
                                            "file, as a config's `model`.")
                     ] = "smollm2-135m-instruct",
    role: Annotated[str, typer.Option(help="What the peers hold: inference (bf16 weights), "
                                           "training (fp32 master and AdamW), lora or "
                                           "lora-int8 (the frozen base in bf16 or int8).")
                    ] = "inference",
) -> None:
    """Choose how many layers each stage gets, from its peers' memory and speed.

    Prints the plan, why each stage got what it got, and the `stage_layers` line to put in
    the run's config."""
    from decentrl.model.loading import model_spec, resolve_model
    from decentrl.model.planner import BYTES_PER_PARAMETER, GIB, PlanError, StageHost, plan_stages

    if role not in BYTES_PER_PARAMETER:
        fail(f"--role must be one of {', '.join(BYTES_PER_PARAMETER)}, got {role!r}")
    hosts = []
    for number, item in enumerate(peers):
        memory, sep, speed = item.partition(":")
        try:
            hosts.append(StageHost(int(float(memory) * GIB), float(speed) if sep else 1.0))
        except ValueError as error:
            fail(f"stage {number}'s peer {item!r} must be MEMORY_GIB:SPEED with both > 0 "
                 f"({error})")
    try:
        choice = plan_stages(model_spec(resolve_model(model)), hosts, role)
    except PlanError as error:
        fail(str(error))
        return
    console.print(choice.describe(), highlight=False)
    console.print(f"num_stages = {len(hosts)}\nstage_layers = {list(choice.plan.stage_layers)}",
                  highlight=False)
