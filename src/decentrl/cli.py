"""The `decentrl` command line: demo, train, coordinate, join, eval, export, report, bench."""

from __future__ import annotations

import importlib.util
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from decentrl.config import ConfigError, RunConfig, load_config, parse_config
from decentrl.observe.logs import configure_logging

if TYPE_CHECKING:
    from decentrl.evaluate.suite import Family, SuiteResult
    from decentrl.release.export import Weights
    from decentrl.swarm.coordinate import SwarmSummary

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training of language models on a swarm of untrusted peers.")
console = Console()

DEMO_CONFIG = {
    "name": "demo",
    "num_stages": 2,
    # No format bonus: it pays a bare wrong number, a trap the policy fell into in 3 runs of 3
    # (3-token answers, training accuracy stuck near 0.1); without it, 0.4-0.5 within 10 steps.
    "task": {"name": "sums", "options": {"min_digits": 1, "max_digits": 2, "format_weight": 0.0}},
    "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 20},
    # 12 minutes of training leave room for the two evaluations inside the 20-minute budget.
    "train": {"mode": "async", "steps": 1000, "time_budget_s": 720, "loss": "grpo", "lr": 3e-5,
              "micro_batch_size": 32, "max_staleness": 2,
              # A dead training peer costs the steps since the last checkpoint (a few seconds
              # to write both stages' weights and optimizer state).
              "checkpoint_every": 5},
    "eval": {"task": {"name": "sums", "options": {"min_digits": 2, "max_digits": 2}},
             "problems": 200, "pass_k": 4, "every": 0},
    # Peers on three continents: every hop 60-120 ms round trip, with jitter.
    "swarm": {"link": {"rtt_ms": [60, 120], "jitter_ms": 10}, "inference_replicas": 2,
              "sessions_in_flight": 8},
    "threads": 1,
}


# The agentic demo: arithmetic word problems with the python tool, in episodes of up to three
# turns. SmolLM2-135M never calls a tool unaided (0 of 32 episodes); with the first call's opening
# prefilled and one worked example as real turns it solves about half of the one-step stories
# greedily, and the tool's format is there for RL to sharpen. Episodes are long (about 450 prompt
# tokens with the tool schema and the example), so fewer, smaller groups make a step.
AGENTIC_TASK = {"name": "agentic-calculator",
                "options": {"stories": ["purchase", "distance"], "prefill_first_call": True,
                            "worked_example": True, "max_turns": 3}}
AGENTIC_DEMO_CHANGES: dict[str, Any] = {
    "task": AGENTIC_TASK,
    # Sampled at T=1, 3-19% of episodes succeed per step where greedy decoding solves 50%, yet
    # the greedy success rose more than at T=0.7 (+20 against +11 points, one run each): T=1
    # samples the long, rambling turns that RL then removes (16 of 64 cut by the budget -> 0).
    "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 80},
    "train": {"micro_batch_size": 8},
    "eval": {"task": AGENTIC_TASK, "problems": 64, "pass_k": 1, "max_new_tokens": 80,
             "batch_size": 16},
}
DEMO_TASKS = ("sums", AGENTIC_TASK["name"])


def demo_config(task: str) -> dict[str, Any]:
    """The demo's config for `task` (one of DEMO_TASKS)."""
    data = json.loads(json.dumps(DEMO_CONFIG))
    if task == AGENTIC_TASK["name"]:
        for section, changes in AGENTIC_DEMO_CHANGES.items():
            data[section] = {**data[section], **changes} if section != "task" else changes
    elif task != "sums":
        raise ValueError(f"the demo runs one of {', '.join(DEMO_TASKS)}, not {task!r}")
    return data


# The release comparison at the demo's end: greedy pass@1 on every family of the default suite
# (the swarm's own evaluation has pass@k), about two minutes for base and model on 2 cores.
DEMO_SUITE_PROBLEMS = 100


def fail(message: str) -> None:
    # stderr: stdout is data for whoever started a peer (its ready line).
    Console(stderr=True).print(f"[red]error:[/] {escape(message)}")
    raise typer.Exit(code=2)


def peak_memory_gib() -> float:
    # ru_maxrss is KiB on Linux and bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def before_after_table(summary) -> Table:
    from decentrl.evaluate.runner import episode_rows, pass1_label

    table = Table(title=f"held-out {summary.before.task} ({summary.before.problems} problems, "
                        "95% CI)")
    table.add_column("")
    table.add_column("before")
    table.add_column("after")
    table.add_row(pass1_label(summary.before), summary.before.pass1.as_percent(),
                  summary.after.pass1.as_percent())
    if summary.before.pass_k is not None and summary.after.pass_k is not None:
        table.add_row(f"pass@{summary.before.k} (T=1)", summary.before.pass_k.as_percent(),
                      summary.after.pass_k.as_percent())
    table.add_row("mean completion tokens", f"{summary.before.mean_completion_tokens:.1f}",
                  f"{summary.after.mean_completion_tokens:.1f}")
    for row in episode_rows(summary.before, summary.after):
        table.add_row(*row)
    return table


def suite_table(result: SuiteResult) -> Table:
    from decentrl.evaluate.suite import suite_table_rows

    header, rows = suite_table_rows(result)
    table = Table(title=f"{escape(result.model)}"
                        + (f" against {escape(result.base)}" if result.base else "")
                        + " (held-out, 95% CI)")
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*map(escape, row))
    return table


def run_suite(model: str | Path, base: str | None, families: Sequence[Family], **options: Any
              ) -> SuiteResult:
    """evaluate_suite under a progress bar; `options` are evaluate_suite's."""
    from decentrl.evaluate.suite import evaluate_suite
    from decentrl.observe.progress import progress_bar

    with progress_bar(console, "evaluating", None) as update:
        return evaluate_suite(
            model, base, families,
            progress=lambda description, done, total: update(done, total, description),
            **options)


def run_training(config: RunConfig) -> None:
    from decentrl.swarm.run import LocalRun

    configure_logging("run", json_file=config.path / "logs" / "run.jsonl")
    started = time.time()
    try:
        summary = LocalRun(config, console).run()
    except (ConfigError, ValueError, FileNotFoundError) as error:
        fail(str(error))
        return
    console.print(before_after_table(summary))
    gain = summary.after.pass1.mean - summary.before.pass1.mean
    console.print(f"pass@1 change: {gain * 100:+.1f} points; {summary.steps} steps; "
                  f"wall {time.time() - started:.0f}s; peak memory {peak_memory_gib():.2f} GiB")
    from decentrl.observe.report import build_report

    console.print(f"run folder: {summary.path}  (final model: {summary.path / 'final'}; report: "
                  f"{build_report(summary.path)})")


@app.command()
def demo(
    name: Annotated[str, typer.Option(help="run name (folder under runs/)")] = "demo",
    budget: Annotated[float, typer.Option(help="training time budget in seconds")] = 720,
    chaos: Annotated[bool, typer.Option(help="kill and restart a random peer every few minutes")]
    = False,
    chaos_every: Annotated[float, typer.Option(help="seconds between chaos kills")] = 120,
    local: Annotated[bool, typer.Option(help="one process, no network (the issue-2 loop)")]
    = False,
    fresh: Annotated[bool, typer.Option(help="delete an earlier run of this name first")] = True,
    adversaries: Annotated[bool, typer.Option(
        help="add one hostile peer of every kind (trust/adversary.py) beside the honest ones")]
    = False,
    task: Annotated[str, typer.Option(
        help=f"what to post-train on: {' or '.join(DEMO_TASKS)} (multi-turn episodes with a "
             "python tool)")] = "sums",
) -> None:
    """Post-train SmolLM2-135M-Instruct over a local swarm on loopback (coordinator plus
    2 stages x (2 inference replicas + 1 training peer), emulated WAN links), on sums or on
    tool-using word-problem episodes; report held-out accuracy (episode success) before and
    after."""
    try:
        data = demo_config(task)
    except ValueError as error:
        fail(str(error))
        return
    data["name"] = name
    data["train"]["time_budget_s"] = budget
    try:
        config = parse_config(data)
    except ConfigError as error:
        fail(str(error))
        return
    if fresh and config.path.exists():
        import shutil

        shutil.rmtree(config.path)
    if local:
        run_training(config)
    else:
        run_swarm_demo(config, chaos_every if chaos else None, adversaries)


def run_swarm_demo(config: RunConfig, chaos_every: float | None, adversaries: bool = False
                   ) -> None:
    import threading

    from decentrl.envs import AGENTIC_ENVIRONMENTS
    from decentrl.evaluate.suite import DEFAULT_SUITE, Family, with_overrides
    from decentrl.model.loading import resolve_model
    from decentrl.observe.report import build_report
    from decentrl.release.export import export_run
    from decentrl.swarm.coordinate import SwarmCoordinator
    from decentrl.swarm.launch import LocalSwarm
    from decentrl.trust.adversary import ADVERSARIES

    exit_on_sigterm()
    started = time.time()
    resolve_model(config.model)  # convert the GGUF once, before the peers race to do it
    config.path.mkdir(parents=True, exist_ok=True)
    configure_logging("coordinator", json_file=config.path / "logs" / "coordinator.jsonl")
    config_path = config.path / "swarm-config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    swarm = LocalSwarm(config, config_path, config.swarm.inference_replicas,
                       adversaries=ADVERSARIES if adversaries else ())
    stop_chaos = threading.Event()
    coordinator = None
    try:
        console.print(f"starting {len(swarm.children) or 'the'} peers (logs in {swarm.logs})")
        swarm.start()
        for line in swarm.layout():
            console.print(f"  {line}")
        assert swarm.bootstrap is not None
        coordinator = SwarmCoordinator(config, swarm.bootstrap, console)
        if chaos_every is not None:
            threading.Thread(target=swarm.chaos, args=(stop_chaos, chaos_every, config.seed,
                                                       console.print), daemon=True).start()
        summary = coordinator.run()
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError, TimeoutError) as error:
        fail(str(error))
        return
    finally:
        stop_chaos.set()
        if coordinator is not None:
            coordinator.close()
        swarm.shutdown()
    if summary.before is not None:
        console.print(before_after_table(summary))
    # The release's own numbers: the exported folder, what people download, against the base,
    # computed here rather than through replicas the run could not fully verify.
    model_dir = export_run(config.path, config.path / "model")
    # A task run is compared on the sums suite; an agentic run on its own environment.
    families = (with_overrides(DEFAULT_SUITE, problems=DEMO_SUITE_PROBLEMS)
                if config.task.name not in AGENTIC_ENVIRONMENTS else
                [Family(config.eval.task.name, dict(config.eval.task.options),
                        problems=config.eval.problems,
                        max_new_tokens=config.eval.max_new_tokens)])
    console.print(f"exported to {model_dir}; comparing it with {config.model} "
                  f"({families[0].problems} held-out problems per family, and the general set)")
    suite = run_suite(model_dir, config.model, families, pass_k=1, seed=config.seed)
    (config.path / "evaluation.json").write_text(json.dumps(suite.to_json(), indent=2))
    console.print(suite_table(suite))
    export_run(config.path, model_dir)  # again: the model card now carries that comparison
    report = build_report(config.path)
    names = {c.info.get("peer_id"): c.name for c in swarm.children.values()}
    restarts = {c.name: c.restarts for c in swarm.children.values() if c.restarts}
    console.print(Panel(demo_summary(summary, time.time() - started, names, restarts, model_dir,
                                     report), title=f"{config.name}: summary", expand=False))


def demo_summary(summary: SwarmSummary, wall_s: float, names: dict[str, str],
                 restarts: dict[str, int], model_dir: Path, report: Path) -> str:
    """The few lines that say how the demo went and where everything is."""
    lines = [f"{summary.steps} steps in {wall_s / 60:.1f} min; generation failovers "
             f"{summary.failovers}, training recoveries {summary.recoveries}, peers restarted "
             f"{restarts or 'none'}"]
    if summary.before is not None:
        gain = summary.after.pass1.mean - summary.before.pass1.mean
        lines.append(f"held-out {summary.after.task} pass@1 {summary.before.pass1.as_percent()} "
                     f"-> {summary.after.pass1.as_percent()} ({100 * gain:+.1f} points)")
    trust = summary.trust
    lines.append(f"trust: {trust['verified']} spot-checks passed, {trust['verify_failed']} "
                 f"failed, {trust['verify_skipped']} skipped; {trust['flagged']} groups flagged "
                 f"by the trainer; {trust['submissions_refused']} submissions refused")
    lines += [f"  banned {escape(names.get(peer, peer[-8:]))}: {escape(why[:160])}"
              for peer, why in summary.banned.items()]
    lines += [f"model:  {model_dir} (Hugging Face folder, model card README.md, SHA256SUMS)",
              f"report: {report}",
              f"logs:   {summary.path / 'logs'} (JSON lines)"]
    if summary.dashboard_url is not None:
        lines.append(f"the dashboard was at {summary.dashboard_url} while the run lasted")
    return "\n".join(lines)


@app.command()
def train(config: Annotated[Path, typer.Option("--config", help="run.toml")]) -> None:
    """Run a post-training job described by a TOML config (resumes from its checkpoint)."""
    try:
        run_config = load_config(config)
    except ConfigError as error:
        fail(str(error))
        return
    run_training(run_config)


def exit_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so `finally` blocks stop what it started."""
    import signal

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


@app.command()
def coordinate(
    config: Annotated[Path, typer.Option("--config", help="run.toml")],
    initial_peers: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="multiaddr of a running peer, repeatable (none: this node bootstraps the swarm)")]
    = None,
    wait: Annotated[float, typer.Option(help="seconds to wait for every stage to have peers")]
    = 600,
) -> None:
    """Coordinate a swarm run: schedule prompts, route generation through inference peers,
    ingest and store rollouts, train the pipeline of training peers, evaluate, checkpoint."""
    from decentrl.net.node import SwarmNode
    from decentrl.net.wire import TensorLimits
    from decentrl.swarm.coordinate import SwarmCoordinator
    from decentrl.swarm.launch import link_profile

    exit_on_sigterm()
    try:
        run_config = load_config(config)
    except ConfigError as error:
        fail(str(error))
        return
    configure_logging("coordinator", json_file=run_config.path / "logs" / "coordinator.jsonl")
    node = SwarmNode.start("coordinator", initial_peers or [], link_profile(run_config),
                           TensorLimits())
    coordinator = None
    try:
        for address in node.addresses():
            console.print(f"peers join with: --initial-peers {address}")
        coordinator = SwarmCoordinator(run_config, node, console)
        summary = coordinator.run(wait_s=wait)
        console.print(f"{summary.steps} steps; after: pass@1 {summary.after.pass1.as_percent()}")
    except (ConfigError, ValueError, RuntimeError, TimeoutError) as error:
        fail(str(error))
    finally:
        if coordinator is not None:
            coordinator.close()
        node.shutdown()


@app.command()
def join(
    stage: Annotated[str, typer.Option(help="stage index, or auto (the least-served stage)")],
    initial_peers: Annotated[list[str], typer.Option(help="multiaddr of a swarm peer, repeatable")],
    role: Annotated[str, typer.Option(help="inference, training or both")] = "inference",
    config: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        "--config", help="run config (default: fetch the coordinator's from the DHT)")] = None,
    run: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="run name, when --config is not given")] = None,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="where a training peer saves and resumes checkpoints")] = None,
    name: Annotated[str, typer.Option(help="a name for logs and the peer table")] = "peer",
    exit_with_parent: Annotated[bool, typer.Option(
        help="stop when the process that started this one exits (used by the local launcher)")]
    = False,
    adversary: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="run a hostile peer instead (trust tests and demos): random-tokens, "
             "forge-logprobs, inject-answers, corrupt-activations, replay or flood")] = None,
    collusion_dir: Annotated[Optional[Path], typer.Option(  # noqa: UP007
        help="folder an inject-answers pair shares")] = None,
    log_json: Annotated[bool, typer.Option(
        help="log JSON lines to stderr (the local launcher makes stderr the peer's log file)")]
    = False,
) -> None:
    """Start a peer that holds exactly the layers of one stage and serves it until stopped."""
    import signal
    import threading

    import torch

    from decentrl.swarm.launch import join as join_swarm
    from decentrl.swarm.protocol import Role
    from decentrl.trust.adversary import ADVERSARIES

    configure_logging(name, json_stderr=log_json)
    if role not in ("inference", "training", "both"):
        fail(f"--role must be inference, training or both, got {role!r}")
    if stage != "auto" and not stage.isdigit():
        fail(f"--stage must be a stage index or auto, got {stage!r}")
    if adversary is not None and adversary not in ADVERSARIES:
        fail(f"--adversary must be one of {', '.join(ADVERSARIES)}, got {adversary!r}")
    try:
        run_config = load_config(config) if config is not None else None
    except ConfigError as error:
        fail(str(error))
        return
    torch.set_num_threads(run_config.threads if run_config and run_config.threads else 1)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        join_swarm(run_config, run, None if stage == "auto" else int(stage),
                   cast(Role, role), initial_peers, checkpoint_dir, name, stop, exit_with_parent,
                   adversary, collusion_dir)
    except (ConfigError, ValueError, RuntimeError, TimeoutError, FileNotFoundError) as error:
        fail(str(error))


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help="Hugging Face folder, or smollm2-135m-instruct")],
    base: Annotated[Optional[str], typer.Option(  # noqa: UP007 - typer needs Optional
        help="the model before post-training: adds before/after changes and the KL divergence "
             "and perplexity against it on a general prompt set")] = None,
    task: Annotated[Optional[str], typer.Option(  # noqa: UP007
        help="evaluate only this task family, e.g. sums, rg:chain_sum or an environment such as "
             "agentic-calculator (default: the suite, two-digit sums and sums of three terms and "
             "of three digits)")] = None,
    option: Annotated[Optional[list[str]], typer.Option(  # noqa: UP007
        help="option of --task, KEY=VALUE (JSON value), repeatable")] = None,
    problems: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="held-out problems per family (default: 100)")] = None,
    pass_k: Annotated[int, typer.Option(help="k of the sampled pass@k (1: greedy only)")] = 4,
    max_new_tokens: Annotated[Optional[int], typer.Option(  # noqa: UP007
        help="completion budget per problem (default: each family's own)")] = None,
    batch_size: int = 64, num_stages: int = 1, device: str = "auto", dtype: str = "auto",
    seed: int = 0,
    output: Annotated[Optional[Path], typer.Option(help="write the result as JSON here")] = None,  # noqa: UP007
) -> None:
    """Held-out pass@1 (greedy) and pass@k (sampled) with 95% confidence intervals on several task
    families; with --base, the changes and the drift from the base on general text."""
    from decentrl.evaluate.suite import DEFAULT_SUITE, Family, with_overrides

    if option and task is None:
        fail("--option needs --task (the default suite's families carry their own options)")
    if output is not None and not output.parent.is_dir():
        fail(f"--output {output}: folder {output.parent} does not exist")
    options = {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--option {item!r} must look like KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    try:
        families = DEFAULT_SUITE if task is None else [Family(task, options)]
        result = run_suite(model, base, with_overrides(families, problems, max_new_tokens),
                           pass_k=pass_k, batch_size=batch_size, num_stages=num_stages,
                           device=device, dtype=dtype, seed=seed)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        fail(str(error))
        return
    console.print(suite_table(result))
    console.print(f"evaluated in {result.seconds:.0f}s")
    if output is not None:
        output.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {output}")


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run folder, e.g. runs/demo")],
    out_dir: Annotated[Path, typer.Argument(help="where the Hugging Face folder goes")],
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    weights: Annotated[str, typer.Option(
        help="served: what the swarm's replicas served (generated the rollouts, answered the "
             "evaluations); learner: the training peers' own (they differ with sparse updates)")]
    = "served",
) -> None:
    """Assemble a run's latest checkpoint (every stage's shard) into a Hugging Face folder that
    transformers.AutoModelForCausalLM loads."""
    from decentrl.release.export import EXPORT_DTYPES, WEIGHTS, export_run

    chosen = {name: dtype_ for dtype_, name in EXPORT_DTYPES.items()}.get(dtype)
    if chosen is None:
        fail(f"--dtype must be one of {', '.join(EXPORT_DTYPES.values())}, got {dtype!r}")
        return
    if weights not in WEIGHTS:
        fail(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    try:
        folder = export_run(run_dir, out_dir, chosen, cast("Weights", weights))
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as error:
        fail(str(error))
        return
    console.print(f"exported {run_dir} to {folder}")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run folder, e.g. runs/demo")]) -> None:
    """Write RUN_DIR/report/report.md with PNG plots (before/after evaluation, reward, staleness,
    throughput, the swarm's peers and traffic, verification events); prints its path."""
    from decentrl.observe.report import build_report

    try:
        path = build_report(run_dir)
    except (ValueError, FileNotFoundError) as error:
        fail(str(error))
        return
    typer.echo(path)  # plain: a script may read the path


BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(help="benchmark name")]) -> None:
    """Run bench/NAME.py (extra arguments are passed on)."""
    if not BENCH_DIR.is_dir():
        fail(f"benchmarks live in the source checkout ({BENCH_DIR} is missing)")
    available = sorted(p.stem.replace("_", "-") for p in BENCH_DIR.glob("*.py")
                       if p.stem != "common")
    path = BENCH_DIR / f"{name.replace('-', '_')}.py"
    if not path.is_file() or path.stem == "common":
        fail(f"unknown benchmark {name!r}; available: {', '.join(available)}")
    sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)
    module.main(list(ctx.args))


if __name__ == "__main__":
    app()
