"""Learning at forced staleness: the same run with every rollout exactly k versions old.

How much does staleness cost, and which off-policy correction pays it back? The demo's run
(examples/demo.toml: sums, SmolLM2-135M-Instruct, groups of 8, 8 prompts per step, lr 3e-5, grpo)
in one process, synchronous, with the generation replica forced to serve the learner's weights
of exactly k versions ago (version 0 until there are that many): every batch the learner at
version v trains on was sampled by version max(0, v - k), so from step k + 1 on its staleness is
exactly k. The learner keeps the last k + 1 versions of each stage in the replica's dtype (what
the replica would load from them, bit for bit). Problems, sampling seeds and initial weights are
the same for every k and method; only the weights that sample differ.

Methods (learn/losses.py; each one a set of `train.*` options):
  none       no correction: the loss ignores mu, stale tokens count as the learner's own
             (off_policy_correction = false)
  tis        decoupled PPO with the behaviour weight pi_prox / mu truncated at 2: the run default
  decoupled  decoupled PPO with the untruncated behaviour weight (tis_cap = null)
  mis        decoupled, untruncated, and sequences whose geometric-mean weight leaves
             [0.5, 2] masked (sequence-level masked importance sampling)
  m2po       decoupled, untruncated, and M2PO's second-moment token mask (m2_threshold = 0.04)
  coupled    classic PPO with pi_old := mu: the clipped ratio pi / mu is the correction
With one optimizer step per batch (the demo's), pi / pi_prox is 1 when the gradient is taken,
so PPO's clip never acts in the decoupled methods; in them the behaviour weight is the whole
correction.

`--mixed K` adds runs whose stages run at different versions: the last stage K versions old and
the others fresh, and the reverse, to set against K on every stage (the rollout records each
stage's version; mu is the log-prob of the mixed chain that actually sampled).

Held-out accuracy is greedy pass@1 on `--eval-problems` held-out two-digit sums (evaluate/
runner.py) after `--steps` steps, with 95% Wilson intervals over the problems (seeds pooled), and
each k's difference to k = 0 under the same method with a Newcombe interval: one that holds 0 is
no significant change. The loop's own sampled evaluations are cut to one problem. The trust
flags are off (they would drop stale rows on purpose; the study is of the loss), and so are
spot-checks (nothing to check in one process). Per run, the curves of behaviour KL (k3 of
KL(mu || pi_prox) per token), mean (log pi_prox / mu)^2, truncated / masked fractions, entropy
and training accuracy.

Run: decentrl bench staleness [--ks 0,1,2,4,8,16,32] [--methods none,tis,mis,decoupled,m2po]
     [--mixed 8] [--steps 100] [--seeds 0] [--eval-problems 200] [--eval-every 0]
     [--threads 2] [--set train.lr=3e-5] [--out runs/bench/staleness] [--json PATH]
     decentrl bench staleness --combine A/staleness.json B/staleness.json --out DIR
     (a grid run in pieces, reported and plotted together; rows of different step counts
     apart)
Smoke: decentrl bench staleness --model tiny --ks 0,2 --methods tis --steps 4 --eval-problems 4
Writes --out/staleness.json, --out/staleness_accuracy.png and --out/staleness_curves.png; the
run folders (metrics.jsonl) under --out/runs. Memory: k + 1 copies of the model in the compute
dtype for the largest k (bf16 SmolLM2-135M at k = 32: about 9 GB)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bench.common import (
    bench_model,
    cpu_seconds,
    machine,
    print_table,
    quiet_transformers,
    save_figure,
)
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.backend import RunSummary
from decentrl.coordinator.local_backend import LocalBackend
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.demo import demo_config
from decentrl.device import pick_device
from decentrl.evaluate.runner import EvalResult, evaluate
from decentrl.evaluate.stats import Accuracy, difference_interval
from decentrl.model.loading import LoadedModel, load_model
from decentrl.observe.metrics import StepRecord
from decentrl.rollout.chain import InferenceSession
from decentrl.rollout.types import RolloutGroup

METHODS: dict[str, dict[str, Any]] = {
    "none": {"off_policy_correction": False},
    "tis": {"tis_cap": 2.0},
    "decoupled": {"tis_cap": None},
    "mis": {"tis_cap": None, "mis_low": 0.5, "mis_high": 2.0},
    "m2po": {"tis_cap": None, "m2_threshold": 0.04},
    "coupled": {"decoupled": False},
}
DEFAULT_METHODS = ("none", "tis", "mis", "decoupled", "m2po")
# What each step's record contributes to a run's curves.
CURVE_FIELDS = ("accuracy", "reward", "staleness_mean", "behaviour_kl", "behaviour_m2",
                "clip_fraction", "tis_weight_mean", "tis_truncated_fraction",
                "mis_masked_fraction", "m2_masked_fraction", "entropy", "grad_norm")
# Columns of the table: (curve field, header), each averaged over a run's steps.
MEAN_COLUMNS = (("behaviour_kl", "KL(mu)"), ("behaviour_m2", "(log w)^2"),
                ("tis_truncated_fraction", "trunc."), ("mis_masked_fraction", "MIS"),
                ("m2_masked_fraction", "M2"), ("clip_fraction", "clip"))


@dataclass(frozen=True)
class Variant:
    """One run: each stage's lag (versions behind the learner), the method and the seed."""

    lags: tuple[int, ...]
    method: str
    seed: int

    @property
    def label(self) -> str:
        """"8" when every stage lags 8, "0/8" when the stages lag differently."""
        return str(self.lags[0]) if len(set(self.lags)) == 1 else "/".join(map(str, self.lags))

    @property
    def name(self) -> str:
        return f"{self.method}-lag{self.label.replace('/', '-')}-seed{self.seed}"


class LaggedBackend(LocalBackend):
    """A synchronous local run whose generation replica serves, on stage i, the learner's
    weights of `lags[i]` versions ago (version 0 until there are that many). It keeps no
    checkpoints and exports nothing: a study run is read from its metrics alone."""

    def __init__(self, config: RunConfig, console: Console, model: LoadedModel,
                 lags: tuple[int, ...]) -> None:
        if config.train.mode != "sync":
            raise ValueError("forced staleness needs train.mode = sync: in async mode the "
                             "generation loop picks its versions itself")
        if len(lags) != config.num_stages:
            raise ValueError(f"{len(lags)} lags for {config.num_stages} stages")
        super().__init__(config, console, model)
        self.lags = lags
        # Per stage: version -> its weights as the replica holds them, for the versions it
        # will still serve (the last `lag`; the one it serves now sits in the transport).
        self.snapshots: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in lags]
        self.served: list[int | None] = [None] * len(lags)
        # Per generated group: the learner's version then, and the group's stage_versions.
        self.sampled: list[tuple[int, list[int]]] = []

    def publish(self) -> None:
        version = self.trainer.version
        for index, (trainer, lag) in enumerate(zip(self.trainer.stage_trainers, self.lags,
                                                   strict=True)):
            replica = self.chain.stages[index].state_dict()
            # Cast as the replica's load would: the copy it serves later is bit for bit this.
            self.snapshots[index][version] = {
                name: tensor.detach().to("cpu", replica[name].dtype, copy=True)
                for name, tensor in trainer.stage.state_dict().items()}
            # The newest published version at least `lag` old (a batch of several updates
            # publishes only its last: versions need not be consecutive).
            served = max((v for v in self.snapshots[index] if v <= version - lag), default=0)
            if served != self.served[index]:
                self.transport.publish_stage(index, served, self.snapshots[index][served])
                self.served[index] = served
            for old in [v for v in self.snapshots[index] if v <= version - lag]:
                del self.snapshots[index][old]

    def generated(self, groups: list[RolloutGroup], sessions: list[InferenceSession]) -> None:
        self.sampled += [(self.trainer.version, list(g.stage_versions)) for g in groups]

    def save_checkpoint(self, version: int, step: int, problem_position: int) -> None:
        pass

    def finish(self, summary: RunSummary) -> RunSummary:
        return summary


@dataclass
class Evaluation:
    step: int
    successes: int
    problems: int


@dataclass
class StudyHooks(RunHooks):
    """Records every step's curve fields and evaluates greedily (before training when
    `evaluate_base`, every `eval_every` steps, and at the end)."""

    eval_problems: int
    eval_every: int
    evaluate_base: bool
    curves: dict[str, list[float | None]] = field(default_factory=dict)
    evaluations: list[Evaluation] = field(default_factory=list)
    base: Evaluation | None = None
    seconds_per_step: list[float] = field(default_factory=list)
    cpu_seconds_per_step: list[float] = field(default_factory=list)
    step_began_cpu: float = 0.0

    def training_started(self, loop: TrainingLoop) -> None:
        if self.evaluate_base:
            self.base = greedy_evaluation(loop, self.eval_problems)

    def before_step(self, loop: TrainingLoop) -> None:
        # Here, not at the last step's end: an evaluation in between is not the step's.
        self.step_began_cpu = cpu_seconds()

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        for name in CURVE_FIELDS:
            self.curves.setdefault(name, []).append(getattr(record, name))
        self.seconds_per_step.append((record.wait_s or 0.0) + (record.train_s or 0.0))
        self.cpu_seconds_per_step.append(cpu_seconds() - self.step_began_cpu)
        if self.eval_every and record.step % self.eval_every == 0:
            self.evaluations.append(greedy_evaluation(loop, self.eval_problems))

    def training_ended(self, loop: TrainingLoop) -> None:
        if not self.evaluations or self.evaluations[-1].step != loop.step:
            self.evaluations.append(greedy_evaluation(loop, self.eval_problems))


def greedy_evaluation(loop: TrainingLoop, problems: int) -> Evaluation:
    chain, _ = loop.backend.evaluation(loop.trainer.version)
    ev = loop.config.eval
    result: EvalResult = evaluate(chain, loop.eval_task, loop.backend.tokenizer, problems,
                                  ev.max_new_tokens, ev.batch_size)
    print(f"  greedy pass@1 at step {loop.step}: {result.pass1.as_percent()}", flush=True)
    return Evaluation(loop.step, round(result.pass1.mean * result.problems), result.problems)


def set_option(data: dict[str, Any], assignment: str) -> None:
    """Apply one `--set section.field=JSON` to the config dict `data`."""
    path, separator, text = assignment.partition("=")
    if not separator or not path:
        raise SystemExit(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.lr=3e-5")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # a bare string, e.g. train.loss=dapo
    *sections, key = path.split(".")
    target = data
    for section in sections:
        target = target.setdefault(section, {})
        if not isinstance(target, dict):
            raise SystemExit(f"--set {assignment!r}: {section} is not a config section")
    target[key] = value


def run_config(args: argparse.Namespace, variant: Variant, model: str) -> RunConfig:
    data = study_data(args, variant.name, variant.seed, model, max(variant.lags))
    # Every run gets the same problems, in the same batches: no curriculum and no dynamic
    # sampling (both choose problems from the run's results).
    data["train"].update(dynamic_sampling=False, **METHODS[variant.method])
    data["curriculum"] = {"enabled": False}
    if args.model == "tiny":
        # The tiny model solves nothing: its groups keep their zero advantages, and weight decay
        # moves its weights from version to version, so that staleness shows in a smoke run.
        data["train"].update(zero_variance_groups="keep", weight_decay=1.0, lr=0.01)
    return study_config(data, args.set)


def study_data(args: argparse.Namespace, name: str, seed: int, model: str,
               max_staleness: int) -> dict[str, Any]:
    """The demo's recipe as a study runs it: in one process under --out/runs, synchronous, for
    --steps without checkpoints, rollouts up to `max_staleness` versions old, the whole batch
    in one micro-batch (M2PO's bound then holds over the batch, as in the paper)."""
    data = demo_config("sums")
    rollout = data["rollout"]
    data.update(name=name, seed=seed, model=model)
    data["host"].update(run_dir=str(args.out / "runs"), device=args.device, dtype=args.dtype,
                        threads=args.threads or 0)
    data["train"].update(mode="sync", steps=args.steps, time_budget_s=None,
                         checkpoint_every=args.steps + 1, max_staleness=max_staleness,
                         micro_batch_size=rollout["group_size"] * rollout["prompts_per_step"])
    return data


def study_config(data: dict[str, Any], assignments: list[str]) -> RunConfig:
    """A study run's config from the demo's `data` as the study changed it: the loop's own
    evaluations cut to one problem (the study evaluates itself), trust flags and spot-checks
    off (the flags drop stale rows on purpose; the study is of the loss), then `--set`."""
    data["eval"].update(problems=1, pass_k=1, every=0)
    data["trust"] = {"verify_fraction": 0.0, "flag_log_ratio": None, "flag_surprise": None}
    for assignment in assignments:
        set_option(data, assignment)
    return parse_config(data)


def run_variant(args: argparse.Namespace, variant: Variant, model: LoadedModel,
                model_name: str, evaluate_base: bool) -> dict[str, Any]:
    config = run_config(args, variant, model_name)
    shutil.rmtree(config.path, ignore_errors=True)
    console = Console(stderr=True, quiet=not args.verbose)
    hooks = StudyHooks(args.eval_problems, args.eval_every, evaluate_base)
    backend = LaggedBackend(config, console, model, variant.lags)
    loop = TrainingLoop(config, backend, console, [hooks])
    started = time.perf_counter()
    try:
        loop.run()
    finally:
        loop.close()
    return {"label": variant.label, "lags": list(variant.lags), "method": variant.method,
            "seed": variant.seed, "steps": loop.step, "wall_s": time.perf_counter() - started,
            "seconds_per_step": hooks.seconds_per_step,
            "cpu_seconds_per_step": hooks.cpu_seconds_per_step, "curves": hooks.curves,
            "evaluations": [vars(e) for e in hooks.evaluations],
            "base": None if hooks.base is None else vars(hooks.base),
            # Per generated group: the learner's version and each stage's sampling version.
            "sampled": backend.sampled}


def variants(args: argparse.Namespace, num_stages: int) -> list[Variant]:
    lags = [(k,) * num_stages for k in args.ks]
    for k in args.mixed:
        lags += [(0,) * (num_stages - 1) + (k,), (k,) + (0,) * (num_stages - 1)]
    return [Variant(lag, method, seed) for method in args.methods for lag in lags
            for seed in args.seeds]


def pooled(runs: list[dict[str, Any]]) -> tuple[int, int]:
    """(successes, problems) of the runs' final evaluations together."""
    finals = [run["evaluations"][-1] for run in runs]
    return sum(e["successes"] for e in finals), sum(e["problems"] for e in finals)


def mean_of(runs: list[dict[str, Any]], name: str) -> float | None:
    values = [v for run in runs for v in run["curves"].get(name, []) if v is not None]
    return statistics.fmean(values) if values else None


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (steps, lags, method), seeds pooled, in the order the runs ran."""
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for run in results:
        groups.setdefault((run["steps"], run["label"], run["method"]), []).append(run)
    rows = []
    for (steps, label, method), runs in groups.items():
        successes, problems = pooled(runs)
        row: dict[str, Any] = {"steps": steps, "label": label, "method": method,
                               "seeds": len(runs),
                               "successes": successes, "problems": problems,
                               "s_per_step": mean_of_steps(runs, "seconds_per_step"),
                               "cpu_s_per_step": mean_of_steps(runs, "cpu_seconds_per_step")}
        baseline = groups.get((steps, "0", method))
        if baseline is not None and label != "0":
            base_successes, base_problems = pooled(baseline)
            row["difference"] = (successes / problems - base_successes / base_problems,
                                 *difference_interval(successes, problems, base_successes,
                                                      base_problems))
        for name, _ in MEAN_COLUMNS:
            row[name] = mean_of(runs, name)
        # The entropy over the last quarter of the steps: where the policy ended up.
        last = [v for run in runs
                for v in run["curves"].get("entropy", [])[-max(1, run["steps"] // 4):]
                if v is not None]
        row["entropy_end"] = statistics.fmean(last) if last else None
        rows.append(row)
    return rows


def mean_of_steps(runs: list[dict[str, Any]], name: str) -> float:
    return statistics.fmean(s for run in runs for s in run[name])


def report(rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    base = next((run["base"] for run in results if run["base"] is not None), None)
    caption = ("pass@1: greedy on held-out two-digit sums, 95% Wilson interval, seeds pooled; "
               "vs lag 0: the difference to lag 0 under the same method and steps, 95% Newcombe "
               "interval; "
               "the other columns are means over the steps (entropy: the last quarter).")
    if base is not None:
        caption += (f" Before training: "
                    f"{Accuracy.from_counts(base['successes'], base['problems']).as_percent()}.")
    table = []
    for row in rows:
        difference = row.get("difference")
        shown = ("-" if difference is None else
                 f"{100 * difference[0]:+.1f} [{100 * difference[1]:+.1f}, "
                 f"{100 * difference[2]:+.1f}]")
        measured = [row[name] for name, _ in MEAN_COLUMNS] + [row["entropy_end"]]
        table.append([row["steps"], row["label"], row["method"],
                      Accuracy.from_counts(row["successes"], row["problems"]).as_percent(),
                      shown, *("-" if value is None else value for value in measured),
                      row["s_per_step"], row["cpu_s_per_step"]])
    print_table("held-out pass@1 at forced staleness (lag: versions behind, per stage when they "
                "differ)",
                ["steps", "lag", "method", "pass@1", "vs lag 0 (points)",
                 *(header for _, header in MEAN_COLUMNS), "entropy", "s/step", "CPU s/step"],
                table, caption)


def plot(rows: list[dict[str, Any]], results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for steps, method in dict.fromkeys((row["steps"], row["method"]) for row in rows):
        uniform = sorted((row for row in rows if (row["steps"], row["method"]) == (steps, method)
                          and "/" not in row["label"]), key=lambda row: int(row["label"]))
        if not uniform:
            continue
        accuracy = [Accuracy.from_counts(row["successes"], row["problems"]) for row in uniform]
        lags = [int(row["label"]) for row in uniform]
        below = [a.mean - a.low for a in accuracy]
        above = [a.high - a.mean for a in accuracy]
        axes.errorbar(lags, [a.mean for a in accuracy], yerr=[below, above], fmt="o-", capsize=3,
                      label=f"{method}, {steps} steps")
    axes.set_xscale("symlog", linthresh=1)
    axes.set_xlabel("staleness k (versions behind the learner)")
    axes.set_ylabel("held-out pass@1 (greedy, 95% CI)")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend()
    save_figure(figure, out / "staleness_accuracy.png")

    panels = (("behaviour_kl", "behaviour KL (nats/token)"), ("behaviour_m2", "mean (log w)^2"),
              ("entropy", "entropy (nats/token)"), ("accuracy", "training accuracy"))
    figure, grid = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for axes, (name, title) in zip(grid.flat, panels, strict=True):
        for run in results:
            values = run["curves"].get(name, [])
            axes.plot(range(1, len(values) + 1),
                      [float("nan") if v is None else v for v in values], linewidth=1,
                      label=f"{run['method']} lag {run['label']} seed {run['seed']}")
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    grid.flat[0].legend(fontsize=6, ncol=2)
    save_figure(figure, out / "staleness_curves.png")


def add_study_arguments(parser: argparse.ArgumentParser, out: Path) -> None:
    """The options a study of runs in one process shares (this one's and bench/entropy.py's)."""
    from decentrl.model.loading import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name, folder, or tiny")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp16"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON",
                        help="change every run's config, e.g. train.lr=1e-5 (repeatable)")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--verbose", action="store_true", help="the runs' own console output")


def parse_list(text: str, kind: type = int) -> list[Any]:
    return [kind(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(prog="decentrl bench staleness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=parse_list, default=[0, 1, 2, 4, 8, 16, 32],
                        help="staleness of every stage, comma-separated")
    parser.add_argument("--mixed", type=parse_list, default=[],
                        help="lags K for the mixed runs: the last stage K behind, then the first")
    parser.add_argument("--methods", type=lambda text: parse_list(text, str),
                        default=list(DEFAULT_METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--seeds", type=parse_list, default=[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also evaluate every N steps (0: only at the end)")
    add_study_arguments(parser, Path("runs/bench/staleness"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: report the runs of these staleness.json files "
                             "together (a grid run in pieces) into --out")
    args = parser.parse_args(argv)
    if args.combine:
        combine(args)
        return
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if not args.ks and not args.mixed:
        parser.error("no staleness to run: give --ks or --mixed")
    if min(args.ks + args.mixed) < 0 or args.steps < 1 or args.eval_problems < 1:
        parser.error("--ks and --mixed must be >= 0, --steps and --eval-problems >= 1")

    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_name = bench_model(args.model)
    model = load_model(model_name)
    # The stage count after --set: any variant's config has it.
    num_stages = run_config(args, Variant((0,), args.methods[0], 0), model_name).num_stages
    runs = variants(args, num_stages)
    if args.mixed and len(runs[0].lags) < 2:
        parser.error("--mixed needs a run of 2 stages or more")
    print(f"{len(runs)} runs of {args.steps} steps on {machine(pick_device(args.device))}",
          flush=True)
    results: list[dict[str, Any]] = []
    for index, variant in enumerate(runs):
        print(f"run {index + 1}/{len(runs)}: {variant.name}", flush=True)
        results.append(run_variant(args, variant, model, model_name, evaluate_base=index == 0))
        print(f"  {results[-1]['wall_s']:.0f} s, "
              f"{statistics.fmean(results[-1]['seconds_per_step']):.2f} s "
              f"({statistics.fmean(results[-1]['cpu_seconds_per_step']):.1f} CPU s) per step",
              flush=True)
        # After every run: a grid of hours keeps what it measured if it stops early.
        write_results(args, summarise(results), results)
    rows = summarise(results)
    report(rows, results)
    plot(rows, results, args.out)


def combine(args: argparse.Namespace) -> None:
    results: list[dict[str, Any]] = []
    for path in args.combine:
        try:
            results += json.loads(path.read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"--combine {path}: not a staleness.json ({error})") from None
    rows = summarise(results)
    write_results(args, rows, results)
    report(rows, results)
    plot(rows, results, args.out)


def write_results(args: argparse.Namespace, rows: list[dict[str, Any]],
                  results: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args), "rows": rows, "runs": results}
    for path in {args.out / "staleness.json", *([Path(args.json)] if args.json else [])}:
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")  # str: the paths


if __name__ == "__main__":
    main()
