"""Learning with sparse against dense weight updates.

Does learning suffer when replicas receive compressed updates? The swarm demo run twice for the
same number of steps, once with sparse updates (sync.mode = "sparse": top-k int8 deltas with
error feedback, the default) and once with dense ones (sync.mode = "dense": every version a
float32 keyframe, so replicas run the trainer's exact weights); held-out accuracy after the same
number of steps, with 95% confidence intervals, and the difference between the two.

Each variant is a fresh local swarm on loopback (`LocalSwarm`: per stage one training peer and
`--replicas` inference peers, each its own process), the demo's config (examples/demo.toml: task,
model, batch, learning rate, 60-120 ms links), a fixed number of `--steps` instead of a time
budget, and the same seed, so both see the same problems in the same order. Evaluation is greedy
pass@1 on `--eval-problems` held-out two-digit sums over the swarm (the replicas), before and
after training. The difference (sparse - dense) comes with a 95% Newcombe interval for the
difference of two independent proportions; an interval that holds 0 means no significant change.
Asynchronous runs differ from run to run even with one seed (which group finishes first depends
on timing), so a single pair of runs bounds the effect only as tightly as its interval says.

Run: decentrl bench update-learning [--steps 25] [--eval-problems 200] [--replicas 2]
     [--variants sparse,dense] [--out runs/update-learning] [--json PATH]
Each variant runs in its own process; run folders under --out, the plot
--out/update_learning.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bench import common
from decentrl.config import RunConfig, parse_config
from decentrl.demo import demo_config
from decentrl.evaluate.stats import difference_interval
from decentrl.observe.metrics import read_metrics

VARIANTS = ("sparse", "dense")


def make_config(args: Any, variant: str, model: str) -> RunConfig:
    data = demo_config("sums")
    data.update(name=variant, seed=args.seed, model=model)
    data["host"].update(run_dir=args.out, device=args.device, dtype=args.dtype)
    data["train"].update(steps=args.steps, time_budget_s=None, checkpoint_every=1_000_000,
                         zero_variance_groups="keep" if args.model == "tiny" else "drop",
                         dynamic_sampling=args.model != "tiny")
    data["eval"].update(problems=args.eval_problems, pass_k=1, every=0)
    data["swarm"]["inference_replicas"] = args.replicas
    data["sync"] = {"mode": variant}
    return parse_config(data)


def run_variant(variant: str, args: Any) -> dict[str, Any]:
    from decentrl.coordinator.swarm_backend import swarm_run
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
        assert swarm.bootstrap is not None
        coordinator = swarm_run(config, swarm.bootstrap, console)
        summary = coordinator.run(wait_s=300)
    finally:
        if coordinator is not None:
            coordinator.close()
        swarm.shutdown()
    assert summary.before is not None
    steps = read_metrics(config.path / "metrics.jsonl").steps
    return {"variant": variant, "steps": summary.steps, "wall_s": summary.wall_s,
            "before": summary.before.to_json(), "after": summary.after.to_json(),
            "accuracy": [s.accuracy for s in steps],
            "run": str(config.path), "machine": common.machine(torch.device("cpu"))}


def pass1(result: dict[str, Any]) -> tuple[float, float, float, int]:
    return (result["pass1"]["mean"], result["pass1"]["low"], result["pass1"]["high"],
            result["pass1"]["n"])


def report(results: list[dict[str, Any]], args: Any) -> None:
    rows, figures = [], {}
    for r in results:
        before, after = pass1(r["before"]), pass1(r["after"])
        rows.append([r["variant"], r["steps"],
                     f"{before[0]:.3f} [{before[1]:.2f}, {before[2]:.2f}]",
                     f"{after[0]:.3f} [{after[1]:.2f}, {after[2]:.2f}]", r["wall_s"]])
        figures[f"{r['variant']}_pass1_after"] = after[0]
    common.print_table(
        f"held-out pass@1 after {args.steps} steps, sparse vs dense weight updates",
        ["updates", "steps", "before [95% CI]", "after [95% CI]", "wall s"], rows,
        caption=f"{args.eval_problems} held-out two-digit sums, greedy; the demo's swarm "
                f"(2 stages x 1 training + {args.replicas} inference peers, 60-120 ms links)\n"
                f"{results[0]['machine']}")
    by_name = {r["variant"]: r for r in results}
    if "sparse" in by_name and "dense" in by_name:
        sparse, dense = pass1(by_name["sparse"]["after"]), pass1(by_name["dense"]["after"])
        low, high = difference_interval(round(sparse[0] * sparse[3]), sparse[3],
                                        round(dense[0] * dense[3]), dense[3])
        figures.update(difference=sparse[0] - dense[0], difference_low=low, difference_high=high)
        verdict = "no significant difference" if low <= 0 <= high else (
            "sparse significantly better" if low > 0 else "sparse significantly WORSE")
        print(f"sparse - dense pass@1: {sparse[0] - dense[0]:+.3f} [{low:+.3f}, {high:+.3f}]: "
              f"{verdict}")
    common.print_figures("update_learning", figures)
    plot(results, Path(args.out) / "update_learning.png")
    common.write_json(args.json, {"bench": "update-learning", "results": results,
                                  "figures": figures})


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for r in results:
        accuracy = r["accuracy"]
        axes.plot(range(1, len(accuracy) + 1), accuracy, marker=".", label=r["variant"])
    axes.set_xlabel("step")
    axes.set_ylabel("training accuracy (sampled, T=1)")
    axes.set_title("sparse vs dense weight updates on the swarm")
    axes.grid(alpha=0.3)
    axes.legend()
    common.save_figure(figure, path)


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser("decentrl bench update-learning", __doc__, "training step", {
        "steps": "training steps per variant", "warmup": "unused by this bench",
        "batch": "unused (the demo's batch)", "threads": "unused (the demo's: 1 per peer)",
        "profile": "unused by this bench", "in_process": "run both variants in this process"})
    parser.set_defaults(steps=25)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2, help="inference peers per stage")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--out", default="runs/update-learning")
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if min(args.steps, args.eval_problems, args.replicas) <= 0:
        parser.error("--steps, --eval-problems and --replicas must be > 0")
    common.run_variants(__spec__.name, argv, args, run_variant, report)


if __name__ == "__main__":
    main()
