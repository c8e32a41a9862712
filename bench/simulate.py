"""A thousand peers: a discrete-event simulation of a decentrl run (src/decentrl/sim/), checked
against runs measured here and projected to an 8B-class model on consumer machines.

Scenarios (`--scenario`):
- `demo`: `decentrl demo` on this machine (sim/presets.py loopback_demo), its compute calibrated
  first by micro-benchmarks of SmolLM2-135M's stages on this host (sim/calibration.py); with
  `--measured RUN_DIR` (a demo's run folder) the measured figures are printed beside the
  simulated ones with their error.
- `netns`: `decentrl demo --netns` (sim/presets.py netns_demo), calibrated the same way.
- `chaos`: `decentrl demo --chaos` (sim/presets.py chaos_demo): the kills of `--measured`'s
  run (its "chaos" records) replayed at the same times.
- `operator`: the multi-host guide walked in network namespaces with a tiny model
  (sim/presets.py operator_swarm; tests/netns/test_operator_netns.py): `--config` the walk's
  run.toml, whose model folder gives the shape.
- `internet`: `--model` (8b: Llama-3.1-8B's shape; 135m) in `--stages` stages on `--peers`
  machines of sim/hardware.py's table over five regions (sim/presets.py internet_swarm), `--nat`
  of them behind NAT, sessions of mean `--session-s`, `--adversaries` of the replicas lying;
  `--plane coordinator`, `peer_to_peer` or `both` (today's design and issue #36's).
  `--recipe` the RL recipe (RECIPES), `--seeds` how many seeds to average (the figures are
  means). `--sweep 100,300,1000` runs each peer count and plots throughput, staleness,
  spot-check share and the coordinator's use against it, the seeds' range shaded
  (bench/figures/simulate_*.png).

Every run prints the figures a real run reports (sim/run.py) and the busiest resources: the
first one is what saturates.

Run: python -m bench.simulate [--scenario demo|netns|chaos|operator|internet] [--measured RUN_DIR]
     [--config TOML] [--speed D,P,T]
     [--model 8b|135m] [--stages 8] [--peers 100] [--plane both] [--duration 1800]
     [--nat 0.3] [--session-s 7200] [--adversaries 0] [--recipe short|reasoning]
     [--sweep N,N,...] [--seed 0] [--seeds 1] [--json PATH]"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench import common
from decentrl.config import RunConfig
from decentrl.config.loading import load_config
from decentrl.sim.costs import Speed
from decentrl.sim.presets import (
    chaos_demo,
    internet_swarm,
    loopback_demo,
    netns_demo,
    operator_swarm,
)
from decentrl.sim.run import SimReport, simulate
from decentrl.sim.scenario import DataPlane, Scenario, Workload
from decentrl.sim.shapes import LLAMA_8B, SMOLLM2_135M

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "bench" / "figures"
SHAPES = {"8b": LLAMA_8B, "135m": SMOLLM2_135M}
# RL recipes at the 8B scale (groups of 8, staleness bound 4, the run's trust defaults,
# activations in bf16), by what they ask of the swarm:
# - reasoning: 64 prompts of 256 tokens a step, answers of up to 1,024 tokens (a reasoning
#   task, kept small);
# - short: 16 prompts a step, answers of up to 256 tokens: what an operator of a swarm on home
#   links would pick, so that a step's sessions end in minutes, not hours.
SWARM_SETTINGS: dict[str, Any] = {
    "swarm": {"max_session_tokens": 1 << 20, "max_cached_tokens_per_sender": 1 << 20,
              "kv_pool_tokens": 1 << 21, "activation_codec": "bf16"},
    "trust": {"history_versions": 8}}
RECIPES: dict[str, tuple[dict[str, Any], Workload]] = {
    "reasoning": ({"rollout": {"group_size": 8, "prompts_per_step": 64, "max_new_tokens": 1024},
                   "train": {"max_staleness": 4, "micro_batch_size": 8}},
                  Workload(prompt_tokens=256, completion_share=(0.2, 1.0), spread_share=0.6)),
    "short": ({"rollout": {"group_size": 8, "prompts_per_step": 16, "max_new_tokens": 256},
               "train": {"max_staleness": 4, "micro_batch_size": 8}},
              Workload(prompt_tokens=128, completion_share=(0.3, 1.0), spread_share=0.6)),
}
# The runs of this host the simulator is checked against (simulate_measured).
MEASURED_SCENARIOS = ("demo", "netns", "chaos", "operator")
# The figures of a run, in the order the tables show them.
SHOWN = ("steps", "generated_tokens_per_s", "trained_tokens_per_s", "rows_stepped_per_s",
         "step_s", "step_wait_s", "step_train_s", "staleness_mean", "policy_rows_per_s",
         "policy_round_trip_s", "decode_round_trip_s", "decode_network_s", "decode_replica_s",
         "decode_coordinator_s", "decode_failover_s", "spot_checks",
         "verify_share_of_replica_compute", "update_propagation_s", "coordinator_sent_mb",
         "coordinator_received_mb", "peer_bytes_mean_mb", "relayed_mb", "failovers", "bans",
         "kills", "rollbacks")


def internet_config(stages: int, recipe: str) -> RunConfig:
    return RunConfig.model_validate({"name": "projection", "num_stages": stages,
                                     **SWARM_SETTINGS, **RECIPES[recipe][0]})


def planes(choice: str) -> list[DataPlane]:
    return ["coordinator", "peer_to_peer"] if choice == "both" else [choice]  # type: ignore


def show(title: str, reports: dict[str, SimReport]) -> None:
    names = list(reports)
    rows: list[list[Any]] = [[key, *(reports[name].figures[key] for name in names)]
                             for key in SHOWN]
    for name in names:
        top = list(reports[name].utilization.items())[:3]
        rows.append([f"busiest ({name})", *["; ".join(f"{k} {v:.0%}" for k, v in top)
                                            if n == name else "" for n in names]])
    common.print_table(title, ["figure", *names], rows)


def run_internet(args: argparse.Namespace, peers: int, seed: int) -> dict[str, SimReport]:
    config = internet_config(args.stages, args.recipe)
    return {plane: simulate(internet_swarm(
        config, SHAPES[args.model], peers, behind_nat=args.nat,
        mean_session_s=args.session_s or None, adversaries=args.adversaries,
        duration_s=args.duration, seed=seed, data_plane=plane,
        workload=RECIPES[args.recipe][1])) for plane in planes(args.plane)}


def over_seeds(args: argparse.Namespace, peers: int) -> list[dict[str, SimReport]]:
    return [run_internet(args, peers, seed) for seed in range(args.seed, args.seed + args.seeds)]


def mean_report(reports: list[SimReport]) -> SimReport:
    """The seeds' mean figures and busy shares (their groups and staleness summed)."""
    def mean(key: str, part: str) -> float:
        return statistics.fmean(getattr(r, part)[key] for r in reports)

    utilization = {key: mean(key, "utilization") for key in reports[0].utilization}
    groups: Counter[str] = Counter()
    staleness: Counter[int] = Counter()
    for r in reports:
        groups.update(r.groups)
        staleness.update(r.staleness)
    return SimReport({key: mean(key, "figures") for key in reports[0].figures}, dict(groups),
                     dict(sorted(staleness.items())),
                     dict(sorted(utilization.items(), key=lambda item: -item[1])))


def plot_sweep(args: argparse.Namespace, counts: list[int],
               runs: list[list[dict[str, SimReport]]]) -> None:
    """Per panel, each data plane's mean over the seeds, and their range shaded."""
    import matplotlib.pyplot as plt

    panels = [("generated_tokens_per_s", "figures", "generated tokens / s"),
              ("staleness_mean", "figures", "mean staleness of trained groups"),
              ("verify_share_of_replica_compute", "figures",
               "spot checks' share of replica compute"),
              ("coordinator uplink", "utilization", "coordinator uplink busy share"),
              ("coordinator CPU", "utilization", "coordinator CPU busy share")]
    figure, axes = plt.subplots(1, len(panels), figsize=(22, 4))
    for axis, (key, part, label) in zip(axes, panels):
        for plane in runs[0][0]:
            values = [[getattr(seeded[plane], part)[key] for seeded in run] for run in runs]
            axis.plot(counts, [statistics.fmean(v) for v in values], marker="o", label=plane)
            axis.fill_between(counts, [min(v) for v in values], [max(v) for v in values],
                              alpha=0.2)
        axis.set(xscale="log", xlabel="peers", title=label)
        axis.legend()
    figure.suptitle(f"{args.model} in {args.stages} stages, recipe {args.recipe!r}, "
                    f"{args.nat:.0%} behind NAT, {args.duration / 3600:.0f} h simulated, "
                    f"{args.seeds} seeds")
    common.save_figure(figure, FIGURES / f"simulate_{args.model}_{args.stages}stages_"
                                         f"{args.recipe}.png")


def simulate_measured(args: argparse.Namespace) -> dict[str, Any]:
    """A run of this host's (`--scenario`), its compute and relaying calibrated here first, then
    simulated; with `--measured`, side by side with what that run's folder measured."""
    from decentrl.model.loading import model_spec
    from decentrl.sim.calibration import calibrate, measured_run
    from decentrl.sim.shapes import ModelShape

    config = load_config(args.config or ROOT / "examples" / "demo.toml")
    measured = None if args.measured is None else measured_run(args.measured)
    host = calibrate(None if args.speed is None
                     else Speed(*map(float, args.speed.split(","))))

    def scenario(plane: DataPlane) -> Scenario:
        if args.scenario == "netns":
            return netns_demo(config, host, args.seed, plane)
        if args.scenario == "chaos":
            assert measured is not None
            return chaos_demo(config, host, measured.kills, args.seed, plane)
        if args.scenario == "operator":
            shape = ModelShape.from_spec(model_spec(Path(config.model)), name="tiny")
            return operator_swarm(config, shape, host, args.seed, plane)
        return loopback_demo(config, host, seed=args.seed, data_plane=plane)

    reports = {plane: simulate(scenario(plane)) for plane in planes(args.plane)}
    speed = host.speed
    show(f"{args.scenario} on this host ({host.cores} cores; speed: decode {speed.decode:.2f}, "
         f"prefill {speed.prefill:.2f}, train {speed.train:.2f})", reports)
    results: dict[str, Any] = {args.scenario: {p: r.figures for p, r in reports.items()}}
    if measured is not None:
        simulated = reports[planes(args.plane)[0]].figures
        common.print_table(f"measured vs simulated ({planes(args.plane)[0]} data plane)",
                           ["figure", "measured", "simulated", "error"],
                           [[key, value, simulated[key],
                             f"{simulated[key] / value - 1:+.0%}" if value else "-"]
                            for key, value in measured.figures.items()])
        results["measured"] = measured.figures
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=(*MEASURED_SCENARIOS, "internet"),
                        default="demo")
    parser.add_argument("--measured", type=Path, help="the run folder of the scenario's real "
                        "run, to compare with (chaos: needed, its kills are replayed)")
    parser.add_argument("--config", type=Path, help="the measured run's config (default: "
                        "examples/demo.toml; operator: the walk's run.toml)")
    parser.add_argument("--speed", help="the host's fitted speeds DECODE,PREFILL,TRAIN (skips "
                        "the calibration's stage timings)")
    parser.add_argument("--model", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--plane", choices=("coordinator", "peer_to_peer", "both"),
                        default="both")
    parser.add_argument("--duration", type=float, default=1800.0, help="simulated seconds")
    parser.add_argument("--nat", type=float, default=0.3, help="share of peers behind NAT")
    parser.add_argument("--session-s", type=float, default=7200.0,
                        help="mean seconds a peer stays (0: nobody leaves)")
    parser.add_argument("--adversaries", type=float, default=0.0,
                        help="share of replicas that lie")
    parser.add_argument("--sweep", help="peer counts to run and plot (internet)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="internet: seeds from --seed on; "
                        "figures are their mean, plots shade their range")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="short",
                        help="internet: the RL recipe (RECIPES)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.stages < 1 or args.peers < 2 * args.stages:
        parser.error("--stages >= 1 and --peers >= 2 x --stages (a training peer and a replica "
                     "per stage) are needed")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if not 0 <= args.nat <= 1 or not 0 <= args.adversaries < 1:
        parser.error("--nat must lie in [0, 1] and --adversaries in [0, 1)")
    if args.scenario == "chaos" and args.measured is None:
        parser.error("--scenario chaos replays a measured run's kills: give --measured RUN_DIR")
    if args.scenario == "operator" and args.config is None:
        parser.error("--scenario operator needs the walk's --config (its run.toml)")
    results: dict[str, Any] = {}
    if args.scenario in MEASURED_SCENARIOS:
        results.update(simulate_measured(args))
    elif args.sweep:
        counts = [int(n) for n in args.sweep.split(",")]
        runs = [over_seeds(args, count) for count in counts]
        means = [{plane: mean_report([seeded[plane] for seeded in run]) for plane in run[0]}
                 for run in runs]
        for count, mean in zip(counts, means):
            show(f"{args.model} in {args.stages} stages on {count} peers, recipe "
                 f"{args.recipe!r}, mean of {args.seeds} seeds", mean)
        plot_sweep(args, counts, runs)
        results.update({f"{count}peers": {plane: r.figures for plane, r in mean.items()}
                        for count, mean in zip(counts, means)})
    else:
        run = over_seeds(args, args.peers)
        reports = {plane: mean_report([seeded[plane] for seeded in run]) for plane in run[0]}
        show(f"{args.model} in {args.stages} stages on {args.peers} peers, recipe "
             f"{args.recipe!r}, mean of {args.seeds} seeds", reports)
        results["internet"] = {plane: r.figures for plane, r in reports.items()}
    swept = args.scenario == "internet" and bool(args.sweep)  # named after their peer count
    flat = {f"{name}_{plane}_{key}" if swept else f"{plane}_{key}": value
            for name, part in results.items() if isinstance(part, dict)
            for plane, figures in part.items() if isinstance(figures, dict)
            for key, value in figures.items() if isinstance(value, float)}
    common.print_figures("simulate", flat)
    common.write_json(args.json, results)


if __name__ == "__main__":
    main()
