"""A run's held-out accuracy and reward against wall-clock.

The learning curve of a run: held-out pass@1 (95% CI) at every evaluation and the training
reward / accuracy per step, against wall-clock seconds, read from the run's metrics.jsonl. Prints
both as tables and saves learning_curve.png in the run folder.

    decentrl bench learning-curve [--run runs/demo] [--every 10] [--window 10]
    decentrl bench learning-curve --train [--budget 900] [--eval-every 10]   # run the demo first

A run evaluated only before and after training gives a curve of two points; `--train` runs the
demo with an evaluation every `--eval-every` steps, so the curve has points in between."""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path
from typing import Any

from bench.common import print_table, save_figure
from decentrl.evaluate.stats import Accuracy
from decentrl.observe.metrics import EvalRecord, StepRecord, read_metrics

PLOT_NAME = "learning_curve.png"


def run_records(run: Path) -> tuple[list[EvalRecord], list[StepRecord]]:
    """(evaluations, steps) of a run folder, in file order."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass --run with a run folder, "
                         "or --train to run the demo first")
    try:
        records = read_metrics(path)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if not records.evals and not records.steps:
        raise SystemExit(f"{path} has no eval or step events")
    return records.evals, records.steps


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def eval_rows(evals: list[EvalRecord]) -> list[list[Any]]:
    rows = []
    for record in evals:
        pass1 = Accuracy(record.pass1, record.pass1_low, record.pass1_high, record.problems)
        rows.append([record.label, record.step, f"{record.elapsed_s:.0f}", pass1.as_percent()])
    return rows


def step_rows(steps: list[StepRecord], every: int) -> list[list[Any]]:
    """One row per `every` steps: the steps it covers, the time at its end, mean reward and
    training accuracy (sampled at the rollout temperature) over them."""
    rows = []
    for start in range(0, len(steps), every):
        chunk = steps[start:start + every]
        rows.append([f"{chunk[0].step}-{chunk[-1].step}", f"{chunk[-1].elapsed_s:.0f}",
                     f"{statistics.fmean(s.reward for s in chunk):.3f}",
                     f"{statistics.fmean(s.accuracy for s in chunk):.3f}"])
    return rows


def plot(evals: list[EvalRecord], steps: list[StepRecord], window: int, title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    if steps:
        axes.plot([s.elapsed_s for s in steps],
                  moving_average([s.accuracy for s in steps], window), color="tab:orange",
                  label=f"training accuracy (sampled, moving average of {window} steps)")
    if evals:
        means = [e.pass1 for e in evals]
        axes.errorbar([e.elapsed_s for e in evals], means,
                      yerr=[[m - e.pass1_low for m, e in zip(means, evals)],
                            [e.pass1_high - m for m, e in zip(means, evals)]],
                      fmt="o-", capsize=4, color="tab:blue",
                      label=f"held-out pass@1 ({evals[0].task or 'eval'}, greedy, 95% CI)")
    axes.set_xlabel("wall-clock seconds")
    axes.set_ylabel("accuracy")
    axes.set_ylim(0, 1)
    axes.grid(alpha=0.3)
    axes.legend(loc="best")
    axes.set_title(title)
    save_figure(figure, path)


def train(run: Path, budget: float, eval_every: int) -> None:
    """The demo run (its config, a fresh folder) with an evaluation every `eval_every` steps."""
    from decentrl.config import parse_config
    from decentrl.coordinator.local_backend import local_run
    from decentrl.demo import demo_config

    data = demo_config("sums")
    data["name"] = run.name
    data["host"]["run_dir"] = str(run.parent)
    data["train"]["time_budget_s"] = budget
    data["eval"]["every"] = eval_every
    config = parse_config(data)
    if config.path.exists():
        shutil.rmtree(config.path)
    local_run(config).run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench learning-curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=Path("runs/demo"), help="run folder")
    parser.add_argument("--every", type=int, default=10, help="steps per training-table row")
    parser.add_argument("--window", type=int, default=10,
                        help="steps in the moving average of training accuracy")
    parser.add_argument("--train", action="store_true",
                        help="run the demo into --run first (replaces an earlier run there)")
    parser.add_argument("--budget", type=float, default=900, help="with --train: seconds")
    parser.add_argument("--eval-every", type=int, default=10,
                        help="with --train: steps between held-out evaluations")
    args = parser.parse_args(argv)
    if args.every < 1 or args.window < 1 or args.eval_every < 1:
        parser.error("--every, --window and --eval-every must be >= 1")
    if args.train:
        train(args.run, args.budget, args.eval_every)
    evals, steps = run_records(args.run)
    if evals:
        print_table(f"{args.run}: held-out pass@1 (greedy, 95% CI)",
                    ["eval", "step", "elapsed s", "pass@1"], eval_rows(evals))
    if steps:
        print_table(f"{args.run}: training, every {args.every} steps",
                    ["steps", "elapsed s", "reward", "accuracy"], step_rows(steps, args.every))
    path = args.run / PLOT_NAME
    plot(evals, steps, args.window, f"{args.run.name}: learning curve", path)


if __name__ == "__main__":
    main()
