"""Learning past the plateau: entropy control and more than one update per batch, over seeds.

The demo's recipe (examples/demo.toml: sums, SmolLM2-135M-Instruct, groups of 8, 8 prompts per
step, lr 1e-5, grpo with TIS) in one process, synchronous, with every rollout exactly `lag`
versions old (bench/staleness.py `LaggedBackend`), under each method in place of the recipe's own
entropy control and updates per batch (RECIPE_ENTROPY_FIELDS):

  baseline     one optimizer step per batch, no entropy control (the recipe before issue #38)
  two_updates  the batch in 2 minibatches, one step each: PPO's clip acts from the second on
  clip_higher  two_updates with an asymmetric clip: [1 - 0.2, 1 + 0.28] (DAPO's clip-higher)
  clip_cov     one step per batch; Clip-Cov stops the gradient of 2% of the tokens, drawn
               among those whose covariance of log-prob and advantage is within (1, 5)
  kl_cov       two_updates with KL-Cov on the 2% of tokens with the largest covariance
  adaptive     one step per batch with an entropy bonus whose coefficient holds 0.6 nats
               (its coefficient moves by 0.005 a step, up to 0.05; adaptive_strong: 0.02, 0.5;
               adaptive_fast: 0.05, 0.5; adaptive_early: 0.05, 0.5, holding 1.0 nats)
Each is a set of `train.*` options (METHODS); `--set` changes any field for every method.

Every run evaluates at each of `--at` steps and at its end, on the held-out problems of the
default suite's families (evaluate/suite.py: two-digit sums, which it trains on; three terms
and three digits, which it does not): greedy pass@1 and sampled pass@k (`--pass-k`). Per step it
records the policy's entropy, the training accuracy and reward, the share of groups without
reward spread, and the entropy method's own measures. The report: per method, lag and
evaluation step, the mean over seeds with a 95% t-interval (seeds are the unit: each run's
accuracy is one value); the fit of training reward R against entropy H, R = -a exp(H) + b (Cui et
al. 2025), over every step of every run of a method; and the curves.

Run: decentrl bench entropy [--methods baseline,clip_cov,...] [--lags 0,8] [--seeds 0,1,2]
     [--steps 60] [--at 30] [--eval-problems 100] [--family-problems 50] [--pass-k 8]
     [--threads 2] [--set train.lr=1e-5] [--out runs/bench/entropy]
     decentrl bench entropy --combine A/entropy.json B/entropy.json --out DIR
Smoke: decentrl bench entropy --model tiny --methods baseline,kl_cov --lags 0 --seeds 0
       --steps 2 --at 1 --eval-problems 2 --family-problems 2 --pass-k 2
Writes --out/entropy.json (after every run: a grid of hours keeps what it measured),
--out/entropy_curves.png and --out/entropy_fit.png."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bench.common import bench_model, machine, print_table, quiet_transformers, save_figure
from bench.staleness import (
    LaggedBackend,
    add_study_arguments,
    parse_list,
    study_config,
    study_data,
)
from decentrl.config import RunConfig
from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.device import pick_device
from decentrl.envs import make_task_or_environment
from decentrl.evaluate.runner import evaluate
from decentrl.evaluate.suite import DEFAULT_SUITE, Family
from decentrl.model.loading import LoadedModel, load_model
from decentrl.observe.metrics import StepRecord

TWO_UPDATES: dict[str, Any] = {"minibatches_per_batch": 2}
METHODS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "two_updates": TWO_UPDATES,
    "clip_higher": {**TWO_UPDATES, "clip_low": 0.2, "clip_high": 0.28},
    "clip_cov": {"entropy": {"method": "clip_cov", "fraction": 0.02,
                             "clip_cov_bounds": [1.0, 5.0]}},
    "kl_cov": {**TWO_UPDATES, "entropy": {"method": "kl_cov", "fraction": 0.02,
                                          "kl_cov_coef": 1.0}},
    "adaptive": {"entropy": {"target": 0.6, "coef_step": 0.005, "max_coef": 0.05}},
    # The first seed's adaptive run reached its cap of 0.05 by step 20 and its entropy still
    # fell to 0.1-0.2: ten times the cap, four times the step.
    "adaptive_strong": {"entropy": {"target": 0.6, "coef_step": 0.02, "max_coef": 0.5}},
    # adaptive_strong's coefficient took 20-30 steps to reach the weight that turned the entropy
    # back up: the same cap, reached in 10.
    "adaptive_fast": {"entropy": {"target": 0.6, "coef_step": 0.05, "max_coef": 0.5}},
    # Every bonus above starts only once the entropy is below 0.6 nats, after about 12 steps, and
    # turns it up after 25-45: too late for a 36-50-step demo. Below 1.0 it starts after about 6.
    "adaptive_early": {"entropy": {"target": 1.0, "coef_step": 0.05, "max_coef": 0.5}},
}
# The demo recipe's own entropy control and updates per batch, which each method sets instead.
RECIPE_ENTROPY_FIELDS = ("entropy", "minibatches_per_batch", "epochs_per_batch", "clip_low",
                         "clip_high")
# What each step's record contributes to a run's curves.
CURVE_FIELDS = ("accuracy", "reward", "entropy", "groups", "zero_variance_groups",
                "clip_fraction", "ratio_mean", "cov_selected_fraction", "entropy_coef",
                "behaviour_kl", "grad_norm")
# Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1).
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class Variant:
    method: str
    lag: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-lag{self.lag}-seed{self.seed}"


@dataclass
class EntropyHooks(RunHooks):
    """Records every step's curve fields and evaluates the families at the `at` steps and at
    the run's end."""

    families: list[Family]
    pass_k: int
    at: set[int]
    curves: dict[str, list[float | None]] = field(default_factory=dict)
    evaluations: list[dict[str, Any]] = field(default_factory=list)

    def after_step(self, loop: TrainingLoop, record: StepRecord) -> None:
        for name in CURVE_FIELDS:
            self.curves.setdefault(name, []).append(getattr(record, name))
        if record.step in self.at:
            self.evaluations.append(evaluate_families(loop, self.families, self.pass_k))

    def training_ended(self, loop: TrainingLoop) -> None:
        if not self.evaluations or self.evaluations[-1]["step"] != loop.step:
            self.evaluations.append(evaluate_families(loop, self.families, self.pass_k))


def evaluate_families(loop: TrainingLoop, families: list[Family], pass_k: int
                      ) -> dict[str, Any]:
    """Greedy pass@1 and sampled pass@k of the learner's weights on each family."""
    chain, _ = loop.backend.evaluation(loop.trainer.version)
    results = {}
    for family in families:
        task = make_task_or_environment(family.task, family.options)
        result = evaluate(chain, task, loop.backend.tokenizer, family.problems,
                          family.max_new_tokens, loop.config.eval.batch_size, pass_k=pass_k,
                          seed=loop.config.seed)
        assert result.pass_k is not None or pass_k == 1
        results[family.label] = {"greedy": result.pass1.mean,
                                 "pass_k": None if result.pass_k is None else result.pass_k.mean,
                                 "problems": result.problems}
        print(f"  step {loop.step}, {family.label}: greedy {100 * result.pass1.mean:.0f}%, "
              f"pass@{pass_k} "
              f"{'-' if result.pass_k is None else f'{100 * result.pass_k.mean:.0f}%'}",
              flush=True)
    return {"step": loop.step, "families": results}


def run_config(args: argparse.Namespace, variant: Variant, model: str) -> RunConfig:
    data = study_data(args, variant.name, variant.seed, model, variant.lag)
    for name in RECIPE_ENTROPY_FIELDS:  # every method starts from the baseline
        data["train"].pop(name, None)
    for name, value in METHODS[variant.method].items():
        data["train"][name] = dict(value) if isinstance(value, dict) else value
    if args.model == "tiny":
        # The tiny model solves nothing: keep its zero-advantage groups so that the loss (and
        # each method's part of it) runs in a smoke run.
        data["train"].update(zero_variance_groups="keep", dynamic_sampling=False)
        data["curriculum"] = {"enabled": False}
    return study_config(data, args.set)


def run_variant(args: argparse.Namespace, variant: Variant, model: LoadedModel,
                model_name: str, families: list[Family]) -> dict[str, Any]:
    config = run_config(args, variant, model_name)
    shutil.rmtree(config.path, ignore_errors=True)
    console = Console(stderr=True, quiet=not args.verbose)
    hooks = EntropyHooks(families, args.pass_k, set(args.at))
    backend = LaggedBackend(config, console, model, (variant.lag,) * config.num_stages)
    loop = TrainingLoop(config, backend, console, [hooks])
    started = time.perf_counter()
    try:
        loop.run()
    finally:
        loop.close()
    return {"method": variant.method, "lag": variant.lag, "seed": variant.seed,
            "steps": loop.step, "version": loop.trainer.version,
            "wall_s": time.perf_counter() - started, "curves": hooks.curves,
            "evaluations": hooks.evaluations}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student-t interval of the mean; degenerate with one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = T_95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def zero_spread_share(run: dict[str, Any]) -> float | None:
    groups = [g for g in run["curves"].get("groups", []) if g]
    zero = [z for z, g in zip(run["curves"].get("zero_variance_groups", []),
                              run["curves"].get("groups", []), strict=True) if g]
    return sum(z or 0.0 for z in zero) / sum(groups) if groups else None


def last_quarter(run: dict[str, Any], name: str) -> float | None:
    values = [v for v in run["curves"].get(name, [])[-max(1, run["steps"] // 4):]
              if v is not None]
    return statistics.fmean(values) if values else None


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, lag, evaluation step): means over seeds with 95% t-intervals."""
    groups: dict[tuple[str, int, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for run in results:
        for evaluation in run["evaluations"]:
            key = (run["method"], run["lag"], evaluation["step"])
            groups.setdefault(key, []).append((run, evaluation))
    rows = []
    for (method, lag, step), members in groups.items():
        row: dict[str, Any] = {"method": method, "lag": lag, "step": step,
                               "seeds": len(members)}
        for label in members[0][1]["families"]:
            for measure in ("greedy", "pass_k"):
                values = [e["families"][label][measure] for _, e in members
                          if e["families"].get(label, {}).get(measure) is not None]
                row[f"{label}|{measure}"] = t_interval(values) if values else None
        for name, value in (("entropy_end", lambda run: last_quarter(run, "entropy")),
                            ("zero_spread", zero_spread_share)):
            values = [v for v in (value(run) for run, _ in members) if v is not None]
            row[name] = t_interval(values) if values else None
        rows.append(row)
    return rows


def entropy_fit(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per method: least squares of training reward R = -a exp(H) + b over every step of its
    runs, with R^2 (Cui et al. 2025 fit it across training; here every step is a point)."""
    fits = {}
    for method in dict.fromkeys(run["method"] for run in results):
        points = [(math.exp(h), r) for run in results if run["method"] == method
                  for h, r in zip(run["curves"]["entropy"], run["curves"]["reward"], strict=True)
                  if h is not None and r is not None]
        if len(points) < 3:
            continue
        xs, ys = zip(*points, strict=True)
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread == 0:
            continue
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        intercept = mean_y - slope * mean_x
        residual = sum((y - slope * x - intercept) ** 2 for x, y in points)
        total = sum((y - mean_y) ** 2 for y in ys)
        fits[method] = {"a": -slope, "b": intercept, "r2": 1 - residual / total if total else 0.0,
                        "points": len(points)}
    return fits


def interval_text(value: tuple[float, float, float] | None, scale: float = 100.0,
                  digits: int = 0) -> str:
    if value is None:
        return "-"
    mean, low, high = (scale * v for v in value)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def report(rows: list[dict[str, Any]], fits: dict[str, dict[str, float]], pass_k: int) -> None:
    labels = [key.split("|")[0] for key in rows[0] if key.endswith("|greedy")] if rows else []
    header = ["method", "lag", "step", "seeds"]
    for label in labels:
        header += [f"{label} greedy %", f"pass@{pass_k} %"]
    header += ["entropy (last quarter)", "zero-spread %"]
    table = []
    for row in rows:
        line = [row["method"], row["lag"], row["step"], row["seeds"]]
        for label in labels:
            line += [interval_text(row.get(f"{label}|greedy")),
                     interval_text(row.get(f"{label}|pass_k"))]
        line += [interval_text(row["entropy_end"], 1.0, 2), interval_text(row["zero_spread"])]
        table.append(line)
    print_table("held-out accuracy by entropy method (mean over seeds, 95% t-interval)", header,
                table, "greedy pass@1 and sampled pass@k per family; entropy in nats per token, "
                "zero-spread: the share of groups without reward spread over the run")
    print_table("training reward against entropy: R = -a exp(H) + b, every step a point",
                ["method", "a", "b", "R^2", "points"],
                [[method, fit["a"], fit["b"], fit["r2"], fit["points"]]
                 for method, fit in fits.items()])


def plot(results: list[dict[str, Any]], fits: dict[str, dict[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(run["method"] for run in results))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    panels = (("entropy", "entropy (nats/token)"), ("accuracy", "training accuracy"),
              ("zero_variance_groups", "groups without reward spread"),
              ("clip_fraction", "clip fraction"))
    figure, grid = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for axes, (name, title) in zip(grid.flat, panels, strict=True):
        for run in results:
            values = run["curves"].get(name, [])
            axes.plot(range(1, len(values) + 1),
                      [float("nan") if v is None else v for v in values], linewidth=1,
                      color=colours[run["method"]], alpha=0.8,
                      linestyle="-" if run["lag"] == 0 else "--")
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    for method in methods:
        grid.flat[0].plot([], [], color=colours[method], label=method)
    grid.flat[0].legend(fontsize=7, title="solid: lag 0, dashed: lagged", title_fontsize=7)
    save_figure(figure, out / "entropy_curves.png")

    figure, axes = plt.subplots(figsize=(7, 5))
    for method in methods:
        points = [(h, r) for run in results if run["method"] == method
                  for h, r in zip(run["curves"]["entropy"], run["curves"]["reward"], strict=True)
                  if h is not None and r is not None]
        if points:
            axes.scatter(*zip(*points, strict=True), s=6, color=colours[method], alpha=0.5,
                         label=method)
        fit = fits.get(method)
        if fit is not None and points:
            hs = sorted(h for h, _ in points)
            axes.plot(hs, [-fit["a"] * math.exp(h) + fit["b"] for h in hs],
                      color=colours[method])
    axes.set_xlabel("entropy H (nats/token)")
    axes.set_ylabel("training reward R")
    axes.set_title("R = -a exp(H) + b per method")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    save_figure(figure, out / "entropy_fit.png")


def write_results(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"args": vars(args), "rows": summarise(results), "fits": entropy_fit(results),
               "runs": results}
    (args.out / "entropy.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def finish(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    write_results(args, results)
    rows, fits = summarise(results), entropy_fit(results)
    report(rows, fits, args.pass_k)
    plot(results, fits, args.out)


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(prog="decentrl bench entropy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", type=lambda text: parse_list(text, str),
                        default=list(METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--lags", type=parse_list, default=[0, 8],
                        help="staleness of every rollout, in versions, comma-separated")
    parser.add_argument("--seeds", type=parse_list, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--at", type=parse_list, default=[30],
                        help="also evaluate after these steps")
    parser.add_argument("--eval-problems", type=int, default=100,
                        help="held-out two-digit sums per evaluation")
    parser.add_argument("--family-problems", type=int, default=50,
                        help="held-out problems of each untrained family per evaluation")
    parser.add_argument("--pass-k", type=int, default=8)
    add_study_arguments(parser, Path("runs/bench/entropy"))
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: report the runs of these entropy.json files together")
    args = parser.parse_args(argv)
    if args.combine:
        results: list[dict[str, Any]] = []
        for path in args.combine:
            try:
                results += json.loads(path.read_text())["runs"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise SystemExit(f"--combine {path}: not an entropy.json ({error})") from None
        finish(args, results)
        return
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if min(args.lags, default=0) < 0 or args.steps < 1 or args.pass_k < 1 \
            or min(args.eval_problems, args.family_problems) < 1:
        parser.error("--lags must be >= 0; --steps, --pass-k and the problem counts >= 1")
    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_name = bench_model(args.model)
    model = load_model(model_name)
    trained, *untrained = DEFAULT_SUITE
    families = [Family(trained.task, trained.options, args.eval_problems,
                       trained.max_new_tokens),
                *(Family(f.task, f.options, args.family_problems, f.max_new_tokens)
                  for f in untrained)]
    runs = [Variant(method, lag, seed) for seed in args.seeds for lag in args.lags
            for method in args.methods]
    print(f"{len(runs)} runs of {args.steps} steps on {machine(pick_device(args.device))}",
          flush=True)
    results = []
    for index, variant in enumerate(runs):
        print(f"run {index + 1}/{len(runs)}: {variant.name}", flush=True)
        results.append(run_variant(args, variant, model, model_name, families))
        print(f"  {results[-1]['wall_s']:.0f} s", flush=True)
        write_results(args, results)
    finish(args, results)


if __name__ == "__main__":
    main()
