"""Async against sync RL: wall-clock to the same accuracy.

Asynchronous against synchronous RL on the swarm: training wall-clock seconds to reach the same
held-out accuracy under emulated WAN latency.

Both variants are the swarm coordinator (`swarm_run`, coordinator/swarm_backend.py) over a fresh
local swarm on loopback (`LocalSwarm`: per stage, one training peer and `--replicas` inference
peers, each a separate process with `--threads` torch threads), with the same config, seed, model,
prompts and problem order:
- `async`: the coordinator as it runs: `--sessions-in-flight` generation threads keep generating
  groups (up to `max_staleness + 1` batches ahead) while the learner trains; rollouts may be up to
  `--max-staleness` versions old (importance-corrected).
- `sync`: the loop with this file's `SyncHooks`, which make it alternate: wait until every
  inference replica serves the learner's current weights, generate exactly one batch
  (`prompts_per_step` groups, the same `--sessions-in-flight` sessions at a time), then train on
  it with no generation running. Every rollout is on-policy (staleness 0).

The coordinator's node carries the emulated link (`--rtt-ms LOW,HIGH` per pair of peers, plus
`--jitter-ms`), as do the peers (replicas fetch weights over it). Both variants evaluate greedy
pass@1 on `--eval-problems` held-out two-digit sums before training and every `--eval-every`
steps. The clock counts training only: it starts after the "before" evaluation, pauses during
every evaluation (no new generation starts during one; a group already in flight finishes), and
stops at the first evaluation whose pass@1 reaches `--target`, or when `--budget` seconds are
spent. The figure is the time to target of each variant and their ratio, sync / async (the target
is >= 1.5). Evaluations are every `--eval-every` steps, so a time to target is the clock at the
first evaluation at or above the target, and each evaluation is a noisy estimate (its 95% interval
is printed).

`--model tiny` (a tiny random model, for a smoke run) never earns a reward, so its groups are kept
even without reward spread (`zero_variance_groups = "keep"`): steps still move the weight
versions, and only a `--target 0` is ever reached.

On a CPU-only machine the peers of both variants share the same cores, and asynchronous training
overlaps generation and training on those cores: what it gains is the hop latency and the idle
time of peers that the synchronous loop leaves unused, not extra hardware.

Run: decentrl bench async-vs-sync [--model smollm2-135m-instruct|tiny|PATH] [--budget 900]
     [--target 0.4] [--eval-every 5] [--eval-problems 200] [--variants async,sync]
     [--out runs/async-vs-sync] [--json PATH]
Each variant runs in its own process; run folders (metrics.jsonl, peer logs) under --out, and the
plot --out/async_vs_sync.png.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bench import common
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.loop import StopTraining, TrainingLoop
from decentrl.coordinator.pool import POLL_S
from decentrl.coordinator.swarm_backend import swarm_run
from decentrl.demo import demo_config
from decentrl.evaluate.runner import EvalResult
from decentrl.observe.metrics import read_metrics

VARIANTS = ("async", "sync")
TARGET_SPEEDUP = 1.5


class BenchHooks(common.GenerationHeldDuringEvaluation):
    """The bench's clock (training seconds, evaluations excluded) and stopping rule (target
    reached or budget spent) on the coordinator's loop, which runs asynchronously as it does.
    No new group starts while an evaluation runs (both variants), so the async variant does not
    get generation done off the clock."""

    def __init__(self, target: float, budget_s: float) -> None:
        super().__init__()
        self.target, self.budget_s = target, budget_s
        self.clock_start: float | None = None
        self.paused_s = 0.0
        self.evaluation_started = 0.0
        self.curve: list[dict[str, Any]] = []
        self.reached_s: float | None = None
        self.frozen_s: float | None = None  # the clock's final reading, once training ends
        self.outcome = "steps"

    def clock(self) -> float:
        if self.frozen_s is not None:
            return self.frozen_s
        if self.clock_start is None:
            return 0.0
        return time.time() - self.clock_start - self.paused_s

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        if label == "after" and self.frozen_s is None:  # the last step: training is over
            self.frozen_s = self.clock()
        super().before_evaluation(loop, label)
        self.evaluation_started = time.time()

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        super().after_evaluation(loop, label, result)
        if self.clock_start is None:  # the evaluation before training: the clock starts now
            self.clock_start = time.time()
        else:
            self.paused_s += time.time() - self.evaluation_started
        point = {"label": label, "step": loop.step, "clock_s": round(self.clock(), 2),
                 "pass1": result.pass1.mean, "low": result.pass1.low, "high": result.pass1.high}
        self.curve.append(point)
        if label != "before" and self.reached_s is None and result.pass1.mean >= self.target:
            self.reached_s = point["clock_s"]
            self.frozen_s = self.clock()
            self.outcome = "target"
            if label == "during":
                raise StopTraining(f"pass@1 reached the target {self.target:.2f}")

    def before_step(self, loop: TrainingLoop) -> None:
        if self.clock() >= self.budget_s:
            self.frozen_s = self.clock()
            self.outcome = "budget"
            raise StopTraining(f"the {self.budget_s:.0f}s budget is spent")


class SyncHooks(BenchHooks):
    """Generate one batch, then train on it, never both at once. The coordinator's generation
    loops run unchanged, but each group needs a ticket: a step hands out `prompts_per_step`
    tickets, the `sessions_in_flight` generation loops turn each into one group, and training
    starts once every ticket's group is generated; no ticket is out while the step trains."""

    def __init__(self, target: float, budget_s: float) -> None:
        super().__init__(target, budget_s)
        self.tickets = threading.Semaphore(0)
        self.generated = threading.Semaphore(0)

    def before_generation(self, loop: TrainingLoop, stop: threading.Event) -> bool:
        if not super().before_generation(loop, stop):
            return False
        while not self.tickets.acquire(timeout=POLL_S):
            if stop.is_set():
                return False
        return True

    def after_generation(self, loop: TrainingLoop, succeeded: bool) -> None:
        if succeeded:
            self.generated.release()
        else:
            self.tickets.release()  # the loop retries with another problem

    def before_step(self, loop: TrainingLoop) -> None:
        super().before_step(loop)
        self.wait_for_every_replica(loop, loop.trainer.version)
        needed = loop.config.rollout.prompts_per_step
        for _ in range(needed):
            self.tickets.release()
        for _ in range(needed):
            while not self.generated.acquire(timeout=POLL_S):
                if loop.stop.is_set():
                    raise RuntimeError("stopped while generating a batch")
        # The training step that follows collects these groups (the coordinator's own ingestion:
        # checked, scored, stored) and trains on them.

    def wait_for_every_replica(self, loop: TrainingLoop, version: int,
                               timeout_s: float = 300.0) -> None:
        """Until every inference replica serves `version` (the stock wait needs one per stage)."""
        directory = loop.backend.directory
        deadline = time.monotonic() + timeout_s
        while True:
            directory.refresh()
            replicas = [r for records in directory.stage_summary() for r in records
                        if r.role == "inference"]
            if replicas and all(r.version == version for r in replicas):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas did not all reach version {version} within "
                                   f"{timeout_s:.0f}s")
            time.sleep(0.1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("async-vs-sync", __doc__, "training step", {
        "batch": "completions per training step (prompts per step x group size)",
        "steps": "most training steps per variant (the budget usually ends it first)",
        "threads": "torch CPU threads per peer",
        "warmup": "unused by this bench", "profile": "unused by this bench",
        "in_process": "run both variants in this process"})
    parser.set_defaults(batch=64, steps=10_000, threads=1)
    parser.add_argument("--budget", type=float, default=900.0,
                        help="training seconds per variant (evaluations excluded)")
    parser.add_argument("--target", type=float, default=0.40, help="held-out pass@1 to reach")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every N steps")
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2, help="inference peers per stage")
    parser.add_argument("--sessions-in-flight", type=int, default=8)
    parser.add_argument("--rtt-ms", default="60,120", help="LOW,HIGH round trip per link")
    parser.add_argument("--jitter-ms", type=float, default=10.0)
    parser.add_argument("--announce-every", type=float, default=1.0,
                        help="peers re-announce (and replicas look for new weights) this often")
    parser.add_argument("--codec", default="bf16", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--out", default="runs/async-vs-sync", help="run folders and the plot")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    try:
        low, high = (float(x) for x in args.rtt_ms.split(","))
    except ValueError:
        parser.error("--rtt-ms must be LOW,HIGH")
    args.rtt = [low, high]
    if args.batch % args.group_size or args.batch < args.group_size:
        parser.error("--batch must be a multiple of --group-size")
    if min(args.budget, args.eval_every, args.eval_problems, args.replicas,
           args.sessions_in_flight, args.threads) <= 0:
        parser.error("--budget, --eval-every, --eval-problems, --replicas, "
                     "--sessions-in-flight and --threads must be > 0")
    return args


def make_config(args: argparse.Namespace, variant: str, model: str) -> RunConfig:
    """The demo's setup (examples/demo.toml), sized by the options; the same for both."""
    demo = demo_config("sums")
    return parse_config({
        "name": variant, "seed": args.seed, "model": model, "num_stages": args.stages,
        "host": {"run_dir": args.out, "device": args.device, "dtype": args.dtype,
                 "threads": args.threads, "link": {"rtt_ms": args.rtt,
                                                   "jitter_ms": args.jitter_ms}},
        "task": demo["task"],  # the demo's task and held-out set
        "rollout": {"group_size": args.group_size,
                    "prompts_per_step": args.batch // args.group_size,
                    "max_new_tokens": args.max_new_tokens},
        "train": {"mode": "async", "steps": args.steps, "loss": "grpo", "lr": args.lr,
                  "micro_batch_size": 32, "max_staleness": args.max_staleness,
                  "checkpoint_every": 1_000_000,
                  # The tiny model's reward is always 0: keep its groups so that steps still
                  # update the weights (zero advantages) and replicas follow new versions.
                  "zero_variance_groups": "keep" if args.model == "tiny" else "drop"},
        "eval": {"task": demo["eval"]["task"], "problems": args.eval_problems,
                 "pass_k": 1, "every": args.eval_every},
        "swarm": {"activation_codec": args.codec, "inference_replicas": args.replicas,
                  "sessions_in_flight": args.sessions_in_flight,
                  # One group per session: the sync variant's tickets are one group each.
                  "groups_per_session": 1,
                  "announce_every_s": args.announce_every},
    })


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from decentrl.launch.local_swarm import LocalSwarm

    common.quiet_transformers()
    torch.set_num_threads(1)  # the coordinator relays and scores; the peers compute
    console = Console(stderr=True)  # live progress (a worker's stdout is read at its end)
    config = make_config(args, variant, common.bench_model(args.model))
    config_path = common.fresh_swarm_folder(config)
    swarm = LocalSwarm(config, config_path, args.replicas)
    coordinator = None
    try:
        swarm.start()
        # The coordinator runs on the bootstrap node: it holds the run owner's key, and carries
        # the emulated link of every inference and training hop.
        assert swarm.bootstrap is not None
        kind = SyncHooks if variant == "sync" else BenchHooks
        hooks = kind(args.target, args.budget)
        coordinator = swarm_run(config, swarm.bootstrap, console, hooks=[hooks])
        coordinator.run(wait_s=300)
        steps = read_metrics(config.path / "metrics.jsonl").steps
        return {
            "variant": variant, "outcome": hooks.outcome, "reached_s": hooks.reached_s,
            "clock_s": hooks.clock(), "steps": coordinator.step,
            "curve": hooks.curve, "generation_errors": coordinator.generation.errors,
            "failovers": coordinator.backend.chain.failovers, "run": str(config.path),
            "staleness_mean": mean([r.staleness_mean for r in steps]),
            "wait_s_mean": mean([r.wait_s for r in steps]),
            "train_s_mean": mean([r.train_s for r in steps]),
            "reward_mean": mean([r.reward for r in steps]),
            "machine": common.machine(torch.device("cpu")),
        }
    finally:
        if coordinator is not None:
            coordinator.close()
        swarm.shutdown()


def mean(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else float("nan")


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    figures: dict[str, float] = {}
    for r in results:
        last = r["curve"][-1] if r["curve"] else None
        per_step = r["clock_s"] / r["steps"] if r["steps"] else float("nan")
        rows.append([r["variant"], r["steps"], r["clock_s"], per_step, r["train_s_mean"],
                     per_step - r["train_s_mean"], r["staleness_mean"],
                     "not reached" if r["reached_s"] is None else r["reached_s"],
                     "-" if last is None else f"{last['pass1']:.3f} [{last['low']:.2f}, "
                                              f"{last['high']:.2f}] @{last['step']}"])
        name = r["variant"]
        figures[f"{name}_steps"] = r["steps"]
        figures[f"{name}_clock_s"] = r["clock_s"]
        if r["steps"]:
            figures[f"{name}_s_per_step"] = per_step
        if r["reached_s"] is not None:
            figures[f"{name}_time_to_target_s"] = r["reached_s"]
    first = results[0]
    caption = (f"target: held-out greedy pass@1 >= {args.target:g} on {args.eval_problems} "
               f"two-digit sums, evaluated every {args.eval_every} steps; clock = training "
               f"seconds (evaluations excluded), budget {args.budget:g} s per variant; "
               f"{args.stages} stages x (1 training + {args.replicas} inference peers), "
               f"{args.threads} thread(s) each; links {args.rtt[0]:g}-{args.rtt[1]:g} ms round "
               f"trip + {args.jitter_ms:g} ms jitter; {args.batch // args.group_size} prompts x "
               f"{args.group_size} samples per step, {args.max_new_tokens} new tokens; "
               f"{args.sessions_in_flight} sessions in flight; other s/step = waiting for rollouts "
               f"(async) or generating them (sync)\n{first['machine']}")
    common.print_table("async vs sync: training seconds to the target accuracy",
                       ["variant", "steps", "clock s", "s/step", "training s/step",
                        "other s/step", "staleness", "s to target", "last pass@1 [95% CI] @step"],
                       rows, caption)
    by_name = {r["variant"]: r for r in results}
    if "async" in by_name and "sync" in by_name:
        fast, slow = by_name["async"], by_name["sync"]
        if fast["reached_s"] is not None and slow["reached_s"] is not None:
            speedup = slow["reached_s"] / max(fast["reached_s"], 1e-9)
            figures["speedup"] = speedup
            print(f"sync / async time to target: {speedup:.2f}x (target >= {TARGET_SPEEDUP})")
        elif fast["reached_s"] is not None:
            bound = args.budget / max(fast["reached_s"], 1e-9)
            print(f"async reached the target in {fast['reached_s']:.0f} s; sync did not within "
                  f"{args.budget:.0f} s: speedup > {bound:.2f}x")
        else:
            print("the target was not reached by async" + (
                "" if slow["reached_s"] is None else " (sync reached it)")
                + "; no speedup figure (raise --budget or lower --target)")
        if fast["steps"] and slow["steps"]:
            step_ratio = (slow["clock_s"] / slow["steps"]) / (fast["clock_s"] / fast["steps"])
            figures["step_time_ratio"] = step_ratio
            print(f"sync / async seconds per step: {step_ratio:.2f}x")
    common.print_figures("async_vs_sync", figures)
    plot(results, args, Path(args.out) / "async_vs_sync.png")
    common.write_json(args.json, {"bench": "async-vs-sync", "args": vars(args),
                                  "results": results, "figures": figures})


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for r in results:
        xs = [p["clock_s"] for p in r["curve"]]
        axes.errorbar(xs, [p["pass1"] for p in r["curve"]],
                      yerr=[[p["pass1"] - p["low"] for p in r["curve"]],
                            [p["high"] - p["pass1"] for p in r["curve"]]],
                      marker="o", capsize=3, label=r["variant"])
    axes.axhline(args.target, color="gray", linestyle=":", label=f"target {args.target:g}")
    axes.set_xlabel("training seconds (evaluations excluded)")
    axes.set_ylabel("held-out pass@1 (95% CI)")
    axes.set_title(f"async vs sync on the swarm, {args.rtt[0]:g}-{args.rtt[1]:g} ms per hop")
    axes.grid(alpha=0.3)
    axes.legend()
    common.save_figure(figure, path)


if __name__ == "__main__":
    main()
