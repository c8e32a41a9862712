"""What `decentrl demo` and `decentrl train` do once their arguments are parsed: the demo's
config (read from its recipe under examples/), a run in this process, a swarm of peers on this
machine with its coordinator, and the release at the end (export, the comparison with the base,
the report), with the tables and the summary a person reads. The cli package parses the
arguments and calls these."""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from decentrl.config import RUN_MODEL_DIR, RunConfig, is_run_folder, read_toml
from decentrl.observe.metrics import ChaosAction, ChaosRecord, MetricsLog
from decentrl.observe.terminal import terminal_text

# The heavy modules (torch, the swarm, matplotlib) are imported where they are used: `decentrl
# --help` reads this module's constants and should not wait for them.
if TYPE_CHECKING:
    from decentrl.coordinator.backend import RunSummary
    from decentrl.evaluate.runner import EvalResult
    from decentrl.evaluate.suite import Family, SuiteResult
    from decentrl.launch.throttle import ThrottleHalfway
    from decentrl.net.netns import Internet

# The demo's recipes, one TOML file per task under the checkout's examples/ (the others extend
# the sums one). Each file says why its values are what they are.
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
DEMO_RECIPES = {"sums": "demo.toml", "agentic-calculator": "demo-agentic-calculator.toml",
                "agentic-countdown": "demo-agentic-countdown.toml",
                "dataset": "demo-dataset.toml"}
DEMO_TASKS = tuple(DEMO_RECIPES)
# With the hostile peers beside the honest ones, about 20 processes share this machine's cores
# and a peer's 2-second announcement round can slip past its 10-second lifetime: honest peers
# then "leave" and "join" over and over. Announcing every 5 s gives each entry 25 s.
ADVERSARIES_ANNOUNCE_EVERY_S = 5.0
# Honest inference replicas per stage beside the hostile peers: one, not the recipe's two (a
# `--set swarm.inference_replicas=2` puts them back). The 12 hostile processes hold about 12 GB,
# the two training peers 3.5-4 GB each at their peak; with a second honest replica per stage
# (about 1 GB each) the OOM killer took a training peer of this 24 GiB machine within 16 steps
# (docs/results.md).
ADVERSARIES_HONEST_REPLICAS = 1
# What each of its 10 inference processes keeps of its sessions for reveals (stage/push.py):
# the defaults (15 minutes, 1 GiB) would keep every session of the run, a few GB across them,
# and the OOM killer took a training peer at step 18 (2026-12-07). A check that comes later
# than this finds nothing to reveal and is skipped, which charges nobody.
ADVERSARIES_REVEAL_WINDOW_S = 180.0
ADVERSARIES_KEPT_ACTIVATIONS_MB = 256.0


def demo_config(task: str) -> dict[str, Any]:
    """The demo's config for `task` (one of DEMO_TASKS), as its recipe file holds it."""
    recipe = DEMO_RECIPES.get(task)
    if recipe is None:
        raise ValueError(f"the demo runs one of {', '.join(DEMO_TASKS)}, not {task!r}")
    path = EXAMPLES_DIR / recipe
    if not path.is_file():
        raise FileNotFoundError(f"the demo's recipes live in the source checkout ({path} is "
                                "missing)")
    return read_toml(path)


# The release comparison at the demo's end: greedy pass@1 on every family of the default suite
# (the swarm's own evaluation has pass@k), about two minutes for base and model on 2 cores.
DEMO_SUITE_PROBLEMS = 100
# The release comparison of an agentic run: greedy episodes, about 50 per level of three.
AGENTIC_RELEASE_PROBLEMS = 140
# A ban's cause (a peer's own error text, often) in the summary.
BAN_CAUSE_CHARS = 160


def peak_memory_gib() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def before_after_table(summary: RunSummary) -> Table:
    """Held-out results before and after training (a resumed run has no "before": see
    after_table)."""
    from decentrl.evaluate.runner import (
        SAMPLED_INTERVALS_NOTE,
        episode_rows,
        has_sampled_rows,
        pass1_label,
    )

    assert summary.before is not None
    table = Table(title=f"held-out {summary.before.task} ({summary.before.problems} problems, "
                        "95% CI)",
                  caption=SAMPLED_INTERVALS_NOTE if has_sampled_rows(summary.before) else None)
    table.add_column("")
    table.add_column("before")
    table.add_column("after")
    table.add_row(pass1_label(summary.before), summary.before.pass1.as_percent(),
                  summary.after.pass1.as_percent())
    if summary.before.greedy_pass1 is not None and summary.after.greedy_pass1 is not None:
        table.add_row("pass@1 (greedy)", summary.before.greedy_pass1.as_percent(),
                      summary.after.greedy_pass1.as_percent())
    if summary.before.pass_k is not None and summary.after.pass_k is not None:
        table.add_row(f"pass@{summary.before.k} (T=1)", summary.before.pass_k.as_percent(),
                      summary.after.pass_k.as_percent())
    table.add_row("mean completion tokens", f"{summary.before.mean_completion_tokens:.1f}",
                  f"{summary.after.mean_completion_tokens:.1f}")
    for row in episode_rows(summary.before, summary.after):
        table.add_row(*row)
    return table


def levels_table(before: EvalResult | None, after: EvalResult,
                 names: tuple[str, str] = ("before", "after")) -> Table | None:
    """The held-out results per difficulty level, before and after training (or the two
    evaluations `names` says); None for an evaluation without levels."""
    from decentrl.evaluate.runner import SAMPLED_INTERVALS_NOTE, has_sampled_rows
    from decentrl.evaluate.suite import level_rows

    rows = level_rows(before, after)
    if not rows:
        return None
    table = Table(title=f"held-out {after.task} per difficulty level, {names[0]} -> {names[1]} "
                        "(95% CI)",
                  caption=SAMPLED_INTERVALS_NOTE if has_sampled_rows(after) else None)
    for column in ("level", "", *names, "change"):
        table.add_column(column)
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def print_evaluation(console: Console, summary: RunSummary) -> None:
    """The run's own held-out evaluation: before and after, then per difficulty level (with a
    supervised warm-up: before -> after it, and after it -> after RL)."""
    if summary.before is not None:
        console.print(before_after_table(summary))
    stages = ([(summary.before, summary.warmup, ("before", "after warm-up")),
               (summary.warmup, summary.after, ("after warm-up", "after RL"))]
              if summary.warmup is not None else [(summary.before, summary.after,
                                                   ("before", "after"))])
    for before, after, names in stages:
        assert after is not None  # the warm-up's when there is one, else the run's last
        levels = levels_table(before, after, names)
        if levels is not None:
            console.print(levels)


def suite_table(result: SuiteResult) -> Table:
    from decentrl.evaluate.runner import SAMPLED_INTERVALS_NOTE
    from decentrl.evaluate.suite import suite_table_rows

    header, rows = suite_table_rows(result)
    table = Table(title=f"{escape(result.model)}"
                        + (f" against {escape(result.base)}" if result.base else "")
                        + " (held-out, 95% CI)",
                  caption=f"pass@{result.pass_k}: {SAMPLED_INTERVALS_NOTE}"
                  if result.pass_k > 1 else None)
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def run_suite(console: Console, model: str | Path, base: str | None, families: Sequence[Family],
              **options: Any) -> SuiteResult:
    """evaluate_suite under a progress bar; `options` are evaluate_suite's."""
    from decentrl.evaluate.suite import evaluate_suite
    from decentrl.progress import progress_bar

    with progress_bar(console, "evaluating", None) as update:
        return evaluate_suite(
            model, base, families,
            progress=lambda description, done, total: update(done, total, description),
            **options)


def fresh_run_folder(config: RunConfig, console: Console) -> None:
    """Delete an earlier run of the demo's name, and nothing that is not a run."""
    if not config.path.exists():
        return
    if not is_run_folder(config.path):
        raise FileExistsError(f"{config.path} exists and does not hold a run, so the demo will "
                              "not delete it; choose another --name, or move that folder")
    console.print(f"deleting the earlier run in {config.path} (--no-fresh keeps it)")
    shutil.rmtree(config.path)


def run_local(config: RunConfig, console: Console) -> None:
    """A run with every stage in this process, then its report."""
    from decentrl.coordinator.local_backend import local_run
    from decentrl.observe.logs import configure_logging
    from decentrl.observe.report import build_report

    configure_logging("run", json_file=config.path / "logs" / "run.jsonl")
    started = time.time()
    loop = local_run(config, console)
    try:
        summary = loop.run()
    finally:
        loop.close()
    print_evaluation(console, summary)
    if summary.before is not None:
        gain = summary.after.pass1.mean - summary.before.pass1.mean
        console.print(f"pass@1 change: {gain * 100:+.1f} points")
    else:
        console.print(f"resumed run; after: pass@1 {summary.after.pass1.as_percent()}")
    console.print(f"{summary.steps} steps; wall {time.time() - started:.0f}s; peak memory "
                  f"{peak_memory_gib():.2f} GiB")
    console.print(f"run folder: {summary.path}  (model: {summary.path / RUN_MODEL_DIR}; report: "
                  f"{build_report(summary.path)})")


# `decentrl demo --netns`: hosts of their own (net/netns.py). Four of the six peers sit behind
# two home NATs, stage 0's training peer and one of its replicas in different homes; the
# coordinator, a relay and one server are on the public segment.
NETNS_PUBLIC = ("coordinator", "relay", "server")
NETNS_HOMES = (("home1", ("train0", "infer1.0")), ("home2", ("infer0.0", "infer1.1")))
NETNS_UPLINK_MBIT = 50.0
# Halfway through training, home2's uplink (a stage-0 and a stage-1 replica) drops to this,
# until training ends.
NETNS_THROTTLED_HOME = 2
NETNS_THROTTLE_MBIT = 0.5
READY_LINE_CHARS = 1000


def netns_placement() -> dict[str, str]:
    placement = {"coordinator": "coordinator", "train1": "server", "infer0.1": "server"}
    placement.update({peer: home for home, peers in NETNS_HOMES for peer in peers})
    return placement


def chaos_reporter(console: Console, metrics: MetricsLog
                   ) -> Callable[[str, ChaosAction, str], None]:
    """What `--chaos` did, on the terminal and as "chaos" records in metrics.jsonl (what the
    simulator replays: bench/simulate.py --scenario chaos)."""
    said = {"killed": "killing {peer}", "back": "{peer} is back",
            "not back": "{peer} did not come back: {detail}"}

    def report(peer: str, action: ChaosAction, detail: str) -> None:
        console.print(f"chaos: {said[action].format(peer=peer, detail=detail)}", markup=False)
        metrics.write(ChaosRecord(peer=peer, action=action, detail=detail[:500]))
    return report


def run_swarm_demo(config: RunConfig, console: Console, chaos_every: float | None,
                   adversaries: bool = False, netns: bool = False) -> None:
    """Peers as processes on this machine, the coordinator here; then the release. With
    `netns`, every process on a host of its own behind real NATs (net/netns.py)."""
    if netns:
        from decentrl.net.netns import HomeSpec, Internet

        # Peers in different homes reach each other only through a relay here (no hole punching
        # between the namespaces' private addresses), and a relayed connection refuses a message
        # over its window: a prefill's push would be refused, so activations go through the
        # coordinator, which every home dials (docs/networking.md).
        config = config.model_copy(update={"swarm": config.swarm.model_copy(
            update={"data_plane": "coordinator"})})
        internet = Internet.start(NETNS_PUBLIC, [HomeSpec([home], NETNS_UPLINK_MBIT)
                                                 for home, _ in NETNS_HOMES])
        try:
            console.print("hosts (Linux network namespaces; nothing leaves this machine):")
            for line in internet.describe():
                console.print(f"  {line}", highlight=False)
            _run_swarm_demo(config, console, chaos_every, adversaries, internet)
        finally:
            internet.close()
    else:
        _run_swarm_demo(config, console, chaos_every, adversaries, None)


def _run_swarm_demo(config: RunConfig, console: Console, chaos_every: float | None,
                    adversaries: bool, internet: Internet | None) -> None:
    from decentrl.coordinator.swarm_backend import swarm_run
    from decentrl.launch.adversary import ADVERSARIES, TRAINING_ADVERSARIES
    from decentrl.launch.local_swarm import LocalSwarm
    from decentrl.launch.throttle import ThrottleHalfway
    from decentrl.model.loading import resolve_model
    from decentrl.observe.logs import configure_logging

    started = time.time()
    resolve_model(config.model)  # convert the GGUF once, before the peers race to do it
    config.path.mkdir(parents=True, exist_ok=True)
    configure_logging("coordinator", json_file=config.path / "logs" / "coordinator.jsonl")
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    # The training adversaries are left out: each needs two honest training peers beside it at
    # its stage for an audit to settle, 3 GB a stage on the CPU, more than this machine's 24 GB
    # hold next to the rest (tests/swarm/test_train_audit.py and bench/train_audit.py show them).
    hostile = [kind for kind in ADVERSARIES if kind not in TRAINING_ADVERSARIES]
    swarm = LocalSwarm(config, config_path, config.swarm.inference_replicas,
                       adversaries=hostile if adversaries else (), internet=internet,
                       placement=netns_placement() if internet is not None else None,
                       relays=["relay"] if internet is not None else ())
    stop_chaos = threading.Event()
    coordinator = None
    throttle: ThrottleHalfway | None = None
    try:
        console.print(f"starting the peers; each is ready once it has loaded its stage (logs "
                      f"in {swarm.logs})")
        # What a peer said of itself (how it is reached, with the errors that told it) is text,
        # never markup.
        swarm.start(on_ready=lambda child: console.print(
            f"  ready: {terminal_text(swarm.describe(child), READY_LINE_CHARS)}",
            highlight=False))
        assert swarm.bootstrap is not None
        coordinator = swarm_run(config, swarm.bootstrap, console)
        if internet is not None:
            home = NETNS_HOMES[NETNS_THROTTLED_HOME - 1][1]
            throttle = ThrottleHalfway(
                internet, NETNS_THROTTLED_HOME, NETNS_THROTTLE_MBIT, NETNS_UPLINK_MBIT,
                coordinator.backend.directory,
                {c.info.get("peer_id", "") for c in swarm.children.values() if c.name in home})
            coordinator.hooks.append(throttle)
        if chaos_every is not None:
            threading.Thread(target=swarm.chaos, daemon=True, args=(
                stop_chaos, chaos_every, config.seed,
                chaos_reporter(console, coordinator.metrics))).start()
        summary = coordinator.run()
    finally:
        stop_chaos.set()
        if coordinator is not None:
            coordinator.close()
        swarm.shutdown()
    print_evaluation(console, summary)
    if throttle is not None and throttle.throttled_at_step is not None:
        console.print(routing_table(throttle))
        (config.path / "routing_under_throttle.json").write_text(json.dumps(
            {"home": throttle.home, "mbit": throttle.mbit, "step": throttle.throttled_at_step,
             "replicas": [dataclasses.asdict(s) for s in throttle.shares()]}, indent=1))
    model_dir, report = release(config, console)
    names = {c.info.get("peer_id"): c.name for c in swarm.children.values()}
    restarts = {c.name: c.restarts for c in swarm.children.values() if c.restarts}
    console.print(Panel(demo_summary(summary, time.time() - started, names, restarts, model_dir,
                                     report), title=f"{config.name}: summary", expand=False))


def routing_table(throttle: ThrottleHalfway) -> Table:
    table = Table(title=f"new sessions per replica, before and after home{throttle.home}'s "
                        f"uplink dropped to {throttle.mbit:g} Mbit/s (step "
                        f"{throttle.throttled_at_step})")
    for column in ("replica", "stage", "behind the throttle", "before", "after"):
        table.add_column(column)
    for share in throttle.shares():
        table.add_row(terminal_text(share.name, READY_LINE_CHARS), str(share.stage),
                      "yes" if share.throttled else "no",
                      f"{share.before} ({100 * share.share_before:.0f}%)",
                      f"{share.after} ({100 * share.share_after:.0f}%)")
    return table


def release(config: RunConfig, console: Console) -> tuple[Path, Path]:
    """A finished swarm run's release, from its run folder: the export, its comparison with the
    base model (the release's own numbers: the exported folder, what people download, computed
    here rather than through replicas the run could not fully verify), the model card with
    them, and the report. Returns the model folder and the report."""
    from decentrl.envs import AGENTIC_ENVIRONMENTS
    from decentrl.evaluate.suite import DEFAULT_SUITE, Family, with_overrides
    from decentrl.observe.report import build_report
    from decentrl.release.export import export_run

    model_dir = export_run(config.path, config.path / RUN_MODEL_DIR, force=True)
    # A task run is compared on the sums suite; an agentic run on its own environment.
    families = (with_overrides(DEFAULT_SUITE, problems=DEMO_SUITE_PROBLEMS)
                if config.task.name not in AGENTIC_ENVIRONMENTS else
                [Family(config.eval.task.name, dict(config.eval.task.options),
                        problems=AGENTIC_RELEASE_PROBLEMS,
                        max_new_tokens=config.eval.max_new_tokens)])
    console.print(f"exported to {model_dir}; comparing it with {config.model} "
                  f"({families[0].problems} held-out problems per family, and the general set)")
    suite = run_suite(console, model_dir, config.model, families, pass_k=1, seed=config.seed)
    (config.path / "evaluation.json").write_text(json.dumps(suite.to_json(), indent=2))
    console.print(suite_table(suite))
    # Again, over the first export: the model card now carries that comparison.
    export_run(config.path, model_dir, force=True)
    return model_dir, build_report(config.path)


def demo_summary(summary: RunSummary, wall_s: float, names: dict[str, str],
                 restarts: dict[str, int], model_dir: Path, report: Path) -> str:
    """The few lines that say how the demo went and where everything is."""
    lines = [f"{summary.steps} steps in {wall_s / 60:.1f} min; generation failovers "
             f"{summary.failovers}, training recoveries {summary.recoveries}, peers restarted "
             f"{restarts or 'none'}"]
    if summary.before is not None:
        gain = summary.after.pass1.mean - summary.before.pass1.mean
        lines.append(f"held-out {summary.after.task} pass@1 {summary.before.pass1.as_percent()} "
                     f"-> {summary.after.pass1.as_percent()} ({100 * gain:+.1f} points)")
        before, after = summary.before.greedy_pass1, summary.after.greedy_pass1
        if before is not None and after is not None:
            lines.append(f"held-out {summary.after.task} greedy pass@1 {before.as_percent()} -> "
                         f"{after.as_percent()} ({100 * (after.mean - before.mean):+.1f} points)")
    trust = summary.trust
    lines.append(f"trust: {trust['verified']} groups spot-checked and passed, "
                 f"{trust['verify_failed']} failed (confirmed), {trust['verify_unconfirmed']} "
                 f"unconfirmed, {trust['verify_skipped']} checks skipped, "
                 f"{trust['verifiers_overruled']} verifiers overruled; {trust['flagged']} groups "
                 f"flagged by the trainer; "
                 f"{trust.get('trained_from_banned', 0)} trained groups came from peers banned "
                 f"later")
    if trust.get("train_audits"):
        lines.append(f"training audits: {trust['train_audits']} steps audited, "
                     f"{trust.get('train_audit_disagreements', 0)} disagreements, "
                     f"{trust.get('train_audit_liars', 0)} liars banned, "
                     f"{trust.get('train_audit_unsettled', 0)} unsettled")
    lines += [f"  banned {terminal_text(names.get(peer, peer[-8:]))}: "
              f"{terminal_text(why, BAN_CAUSE_CHARS)}" for peer, why in summary.banned.items()]
    lines += [f"model:  {model_dir} (Hugging Face folder, model card README.md, SHA256SUMS)",
              f"report: {report}",
              f"logs:   {summary.path / 'logs'} (JSON lines)"]
    if summary.dashboard_url is not None:
        lines.append(f"the dashboard was at {summary.dashboard_url} while the run lasted")
    return "\n".join(lines)
