"""What `decentrl demo` and `decentrl train` do once their arguments are parsed: the demo's
config, a run in this process, a swarm of peers on this machine with its coordinator, and the
release at the end (export, the comparison with the base, the report), with the tables and the
summary a person reads. cli.py parses the arguments and calls these."""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from decentrl.config import RunConfig, is_run_folder
from decentrl.observe.terminal import terminal_text

# The heavy modules (torch, the swarm, matplotlib) are imported where they are used: `decentrl
# --help` reads this module's constants and should not wait for them.
if TYPE_CHECKING:
    from decentrl.evaluate.runner import EvalResult
    from decentrl.evaluate.suite import Family, SuiteResult
    from decentrl.net.netns import Internet
    from decentrl.swarm.loop import RunSummary
    from decentrl.swarm.throttle import ThrottleHalfway

DEMO_CONFIG = {
    "name": "demo",
    "num_stages": 2,
    # No format bonus: it pays a bare wrong number, a trap the policy fell into in 3 runs of 3
    # (3-token answers, training accuracy stuck near 0.1); without it, 0.4-0.5 within 10 steps.
    "task": {"name": "sums", "options": {"min_digits": 1, "max_digits": 2, "format_weight": 0.0}},
    "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 20},
    # Problems likely to have reward spread first: simulated on the base model's outcomes, 42% of
    # groups without spread against 72% (bench/README.md, curriculum); the `3f4f540` run still
    # had 57%, since a bucket mixes problems always and never solved. So problems whose own
    # group varied come back, each up to 12 more times, for up to 4 in 5 of the groups: 19% in
    # the same simulation (6 times, 3 in 4: 25%).
    "curriculum": {"enabled": True, "replay_share": 0.8, "max_replays": 12},
    # 12 minutes of training, then two evaluations of about 3 minutes each (8 sampled rows per
    # problem, in sessions shaped like training groups): `make demo` takes about 20 minutes.
    # lr 1e-5, not 3e-5: at 3e-5 the policy's entropy fell from 2.2 to 0.1 in 13 steps and
    # 8-version-old rollouts taught nothing; at 1e-5 the in-process study (bench/README.md,
    # staleness) learned as well at 8 versions stale as fresh, and better than 3e-5 at 30 steps.
    # So rollouts up to 8 versions old are corrected (TIS) rather than dropped.
    "train": {"mode": "async", "steps": 1000, "time_budget_s": 720, "loss": "grpo", "lr": 1e-5,
              "micro_batch_size": 32, "max_staleness": 8,
              # The few groups that still vary once the policy solves most problems (1-3 at 97%
              # training accuracy) still make a full-size Adam step, mostly noise: probably why
              # a run of 65 steps fell from 0.97 to 0.3-0.5 training accuracy. Fill every batch.
              "dynamic_sampling": True,
              # A dead training peer costs the steps since the last checkpoint (a few seconds
              # to write both stages' weights and optimizer state).
              "checkpoint_every": 5},
    "eval": {"task": {"name": "sums", "options": {"min_digits": 2, "max_digits": 2}},
             "problems": 100, "pass_k": 4, "every": 0},
    # Peers on three continents: every hop 60-120 ms round trip, with jitter.
    "swarm": {"link": {"rtt_ms": [60, 120], "jitter_ms": 10}, "inference_replicas": 2},
    # Spot-checks rewind a replica to the version a rollout names: as far as the staleness bound
    # and the checks' own lag behind generation (with 8, a third of the skipped checks of the
    # `3f4f540` run found the replica already 9 versions on).
    "trust": {"history_versions": 12},
    "threads": 1,
}


# The agentic demos: word problems with the python tool (one, two and three chained calls), and
# countdown with the check tool. SmolLM2-135M never calls a tool unaided (0 of 32 episodes); with
# the first call's opening prefilled and one worked example as real turns it solves about half of
# the one-step stories greedily, and none of the chained ones: neither it nor RL alone ever
# chained two calls (issue #7). So a run first learns from the environment's own demonstrations
# (a scripted solver's transcripts of train problems, `supervised`), then RL takes over with a
# few demonstrations in every step; the curriculum hands out the levels whose groups vary.
# Episodes are long (about 450 prompt tokens with the tool schema and the example, up to ~170
# completion tokens for three calls), so fewer, smaller groups make a step.
AGENTIC_TASK = {"name": "agentic-calculator",
                "options": {"stories": ["purchase", "distance", "shopping", "travel", "saving",
                                        "baking", "ages"],
                            "prefill_first_call": True, "worked_example": True, "max_turns": 4,
                            # Per call whose result a later call or the answer uses, up to 0.1
                            # an episode: the path is paid, never as much as the answer.
                            "used_result_bonus": 0.05, "max_shaping": 0.1}}
# Two to four numbers: the curriculum starts where a target is one operation away.
COUNTDOWN_TASK = {"name": "agentic-countdown",
                  "options": {"config": {"min_numbers": 2, "max_numbers": 4},
                              "prefill_first_call": True, "max_turns": 6, "max_tool_calls": 6}}
AGENTIC_DEMO_CHANGES: dict[str, Any] = {
    "task": AGENTIC_TASK,
    # Sampled at T=1: T=1 samples the long, rambling turns that RL then removes (issue #7: +20
    # against +11 points at T=0.7, one run each).
    "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 192},
    "curriculum": {"enabled": True, "replay_share": 0.5, "max_replays": 6},
    # Demonstrations at 5x the RL learning rate for the warm-up, then 4 beside every RL batch so
    # that RL cannot forget the format while it sharpens the solutions.
    "supervised": {"warmup_steps": 24, "rows_per_step": 16, "lr": 5e-5, "interleave_rows": 4},
    # Longer than the sums demo: on 2 cores a warm-up step takes ~75 s through the swarm (37 s
    # in one process), so the 24 take ~30 minutes of the budget and RL (~2-3 minutes a step)
    # the rest. Micro-batches of 4: a demonstration row is ~540 tokens, and 8 of them held
    # ~11 GB of activations in one process.
    "train": {"micro_batch_size": 4, "dynamic_sampling": False, "time_budget_s": 2700},
    # The run's own evaluation samples a group per problem (about 4 minutes for 21 problems on
    # one process), three times (before, after the warm-up, after RL): few problems, wide
    # intervals per level. The release comparison, greedy on the exported folder, takes
    # AGENTIC_RELEASE_PROBLEMS.
    "eval": {"task": AGENTIC_TASK, "problems": 21, "pass_k": 1, "max_new_tokens": 192,
             "batch_size": 16},
}
# A check's report is longer than a calculator result, and a revision adds a turn.
COUNTDOWN_DEMO_CHANGES: dict[str, Any] = {
    **AGENTIC_DEMO_CHANGES,
    "task": COUNTDOWN_TASK,
    "rollout": {**AGENTIC_DEMO_CHANGES["rollout"], "max_new_tokens": 256},
    "eval": {**AGENTIC_DEMO_CHANGES["eval"], "task": COUNTDOWN_TASK, "max_new_tokens": 256},
}
DEMO_TASKS = ("sums", AGENTIC_TASK["name"], COUNTDOWN_TASK["name"])
# With the hostile peers beside the honest ones, about 20 processes share this machine's cores
# and a peer's 2-second announcement round can slip past its 10-second lifetime: honest peers
# then "leave" and "join" over and over. Announcing every 5 s gives each entry 25 s.
ADVERSARIES_ANNOUNCE_EVERY_S = 5.0


def demo_config(task: str) -> dict[str, Any]:
    """The demo's config for `task` (one of DEMO_TASKS)."""
    data = json.loads(json.dumps(DEMO_CONFIG))
    agentic = {AGENTIC_TASK["name"]: AGENTIC_DEMO_CHANGES,
               COUNTDOWN_TASK["name"]: COUNTDOWN_DEMO_CHANGES}
    if task in agentic:
        for section, changes in agentic[task].items():
            data[section] = {**data.get(section, {}), **changes} if section != "task" \
                else changes
    elif task != "sums":
        raise ValueError(f"the demo runs one of {', '.join(DEMO_TASKS)}, not {task!r}")
    return data


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
    from decentrl.observe.logs import configure_logging
    from decentrl.observe.report import build_report
    from decentrl.swarm.local import local_run

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
    console.print(f"run folder: {summary.path}  (final model: {summary.path / 'final'}; report: "
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


def run_swarm_demo(config: RunConfig, console: Console, chaos_every: float | None,
                   adversaries: bool = False, netns: bool = False) -> None:
    """Peers as processes on this machine, the coordinator here; then the release. With
    `netns`, every process on a host of its own behind real NATs (net/netns.py)."""
    if netns:
        from decentrl.net.netns import HomeSpec, Internet

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
    from decentrl.model.loading import resolve_model
    from decentrl.observe.logs import configure_logging
    from decentrl.swarm.adversary import ADVERSARIES, TRAINING_ADVERSARIES
    from decentrl.swarm.coordinate import swarm_run
    from decentrl.swarm.launch import LocalSwarm
    from decentrl.swarm.throttle import ThrottleHalfway

    started = time.time()
    resolve_model(config.model)  # convert the GGUF once, before the peers race to do it
    config.path.mkdir(parents=True, exist_ok=True)
    configure_logging("coordinator", json_file=config.path / "logs" / "coordinator.jsonl")
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    # The training adversaries are left out: each needs two honest training peers beside it at
    # its stage for an audit to settle, 3 GB a stage on the CPU, more than this machine's 24 GB
    # hold next to the rest (tests/test_train_audit.py and bench/train_audit.py show them).
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
            threading.Thread(target=swarm.chaos, args=(stop_chaos, chaos_every, config.seed,
                                                       console.print), daemon=True).start()
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

    model_dir = export_run(config.path, config.path / "model", force=True)
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
