"""Training-peer audits: the tolerance's calibration and the audits' cost.

What runs, in this process: the model as a chain of local stage trainers (the primary, fp32,
`--threads` threads) trains `--steps` steps on random batches of the demo's shape. Before each
step every auditor (`fp32 x2 threads`: fp32 with twice the threads; `bf16`: bf16 autocast) loads
the primary's pre-step state of every stage (trust/audit.py FlatState) and replays the whole
chain on the same batch; a poisoner does the same on the batch with its advantages negated
(gradient ascent on the reward: the most harmful update for the same compute). Per stage the
gradient disagreement with the primary (trust/audit.py `gradient_error`, relative L2, worst
tensor) is recorded, and the primary's step must pass `check_step`. A swarm auditor replays one
stage from the primary's recorded inputs; replaying the chain lets differences grow from stage to
stage, so the honest figures here are an upper bound of what an audit sees.

Subtler poisons, each replayed the same way and compared with the primary's honest step at every
stage: the advantages of 1, 2, 4, ... of the rows negated (a few rows of ascent hidden in an
honest step), and every advantage scaled (x1.25, x1.5, x2, x4: the honest direction, a longer
step). A table gives each one's disagreement and the share of stage audits above the tolerance;
`smallest_rows_negated_caught` and `smallest_scale_caught` are the smallest of each family that
every audit catches (inf: none).

Figures: `honest_max_threads`, `honest_max_bf16` (worst over stages and steps), `poisoned_min`
(the smallest a poisoner reaches), `tolerance` (trust.train_audit_tolerance); `reversed_caught`
(the share of reversed updates, the poison-update adversary's, that check_step refuses, with its
STEP_SLACK: by the coordinator alone, without a replay);
and cost: `step_s` (one training step of the chain), `snapshot_s` (every stage's state copied and
hashed, each step, on every primary), `replay_s` (a replay of every stage, in the primary's precision and threads), `check_s`
(the coordinator's checks of every stage), `state_mib` (every stage's state; an audit moves four
of it through the coordinator: pre and post from the primary, pre to the auditor, its post back),
and `audit_cost_fraction`: (snapshot + f x (replay + check)) / step at f =
trust.train_audit_fraction, the audits' share of training compute.

Run: decentrl bench train_audit [--model smollm2-135m-instruct|tiny] [--steps 4] [--plot PATH]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import common
from decentrl.config import RunConfig, TrainConfig
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import load_model
from decentrl.model.stages import StagePlan, build_stages
from decentrl.rollout.sampling import SamplingConfig
from decentrl.rollout.types import Rollout
from decentrl.trust.audit import (
    FlatState,
    check_step,
    flat_state,
    gradient_error,
    load_flat_state,
    state_digest,
)

AUDITORS = {"threads": torch.float32, "bf16": torch.bfloat16}
SCALES = (1.25, 1.5, 2.0, 4.0)
Poison = Callable[[TrainBatch], TrainBatch]


def random_batch(seed: int, rows: int, prompt: int, completion: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rollouts = [Rollout(prompt_tokens=torch.randint(1, vocab, (prompt,), generator=g).tolist(),
                        completion_tokens=torch.randint(1, vocab, (completion,),
                                                        generator=g).tolist(),
                        behaviour_logprobs=[-2.0] * completion, finished=True)
                for _ in range(rows)]
    advantages = torch.randn(rows, generator=g).tolist()
    return build_batch(rollouts, advantages, [0] * rows, 0)


def with_advantages(batch: TrainBatch, advantages: torch.Tensor) -> TrainBatch:
    return TrainBatch(**{**batch.__dict__, "advantages": advantages})


def negated(batch: TrainBatch) -> TrainBatch:
    """Every advantage negated: gradient ascent on the reward, the easiest poison to see."""
    return with_advantages(batch, -batch.advantages)


def rows_negated(rows: int) -> Poison:
    """The first `rows` rows' advantages negated: a poisoner that hides a few rows of ascent in
    an otherwise honest step."""
    def poison(batch: TrainBatch) -> TrainBatch:
        advantages = batch.advantages.clone()
        advantages[:rows] = -advantages[:rows]
        return with_advantages(batch, advantages)
    return poison


def scaled(factor: float) -> Poison:
    """Every advantage times `factor`: the honest direction with a larger step."""
    return lambda batch: with_advantages(batch, factor * batch.advantages)


def poisons(rows: int) -> dict[str, Poison]:
    """The poisons tried, each family from the subtlest up: a few rows negated (1, 2, 4, ...,
    every row: the full ascent), and the advantages scaled (x1.25 ... x4)."""
    counts = [2 ** i for i in range(rows.bit_length()) if 2 ** i < rows] + [rows]
    return {**{f"{count} of {rows} rows negated": rows_negated(count) for count in counts},
            **{f"advantages x{factor:g}": scaled(factor) for factor in SCALES}}


def chain(model, stages: int, train: TrainConfig, dtype: torch.dtype) -> PipelineTrainer:
    plan = StagePlan.even(model.spec.num_layers, stages)
    modules = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)
    return PipelineTrainer.local(modules, train, loss_config_from(train, 64),
                                 SamplingConfig(temperature=1.0), dtype)


def replay(pipeline: PipelineTrainer, pre: list[FlatState], batch: TrainBatch
           ) -> list[FlatState]:
    for trainer, state in zip(pipeline.stage_trainers, pre):
        load_flat_state(trainer, state)
    pipeline.train_step(batch)
    return [flat_state(trainer) for trainer in pipeline.stage_trainers]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=24)
    parser.add_argument("--completion-length", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    defaults = RunConfig()
    train = TrainConfig(lr=defaults.train.lr, micro_batch_size=4)
    fraction = defaults.trust.train_audit_fraction
    tolerance = defaults.trust.train_audit_tolerance
    model = load_model(common.bench_model(args.model))
    torch.set_num_threads(args.threads)
    primary = chain(model, args.stages, train, torch.float32)
    other = chain(model, args.stages, train, torch.float32)  # each auditor, then the poisoner
    errors: dict[str, list[float]] = {name: [] for name in [*AUDITORS, "poisoned"]}
    timings: dict[str, list[float]] = {"step": [], "snapshot": [], "replay": [], "check": []}
    reversed_caught: list[bool] = []
    tried = poisons(args.rows)
    detection: dict[str, list[list[float]]] = {label: [] for label in tried}  # [step][stage]
    worst: dict[str, tuple[float, str]] = {}  # per auditor: its largest disagreement, and where
    for step in range(args.steps):
        batch = random_batch(step, args.rows, args.prompt_length, args.completion_length,
                             model.spec.vocab_size)
        pre = [flat_state(t) for t in primary.stage_trainers]
        started = time.perf_counter()
        primary.train_step(batch)
        timings["step"].append(time.perf_counter() - started)
        started = time.perf_counter()
        post = [flat_state(t) for t in primary.stage_trainers]
        for state in post:
            state_digest(state.version, state.step, state.names, state.sizes, state.flat)
        timings["snapshot"].append(time.perf_counter() - started)
        for name, dtype in AUDITORS.items():
            for trainer in other.stage_trainers:
                trainer.autocast_dtype = dtype
            torch.set_num_threads(2 * args.threads if name == "threads" else args.threads)
            redone = replay(other, pre, batch)
            torch.set_num_threads(args.threads)
            started = time.perf_counter()
            for before, ours, theirs in zip(pre, post, redone):
                assert check_step(before, ours, train) is None, "an honest step failed its check"
                error, where = gradient_error(before, ours, theirs, train.betas[0])
                errors[name].append(error)
                worst[name] = max(worst.get(name, (0.0, "")), (error, where))
            if name == "threads":
                timings["check"].append(time.perf_counter() - started)
            del redone
        for trainer in other.stage_trainers:
            trainer.autocast_dtype = torch.float32
        started = time.perf_counter()  # a replay on the primary's threads and precision
        poisoned = replay(other, pre, negated(batch))
        timings["replay"].append(time.perf_counter() - started)
        errors["poisoned"] += [gradient_error(before, ours, theirs, train.betas[0])[0]
                               for before, ours, theirs in zip(pre, poisoned, post)]
        del poisoned
        # Each poison's claimed step against the honest one, stage by stage: what an auditor
        # replaying that stage would see.
        for label, poison in tried.items():
            claimed = replay(other, pre, poison(batch))
            detection[label].append([gradient_error(before, ours, theirs, train.betas[0])[0]
                                     for before, ours, theirs in zip(pre, claimed, post)])
            del claimed
        # The poison-update adversary: the honest step, reversed, with honest moments.
        for before, ours in zip(pre, post):
            weights = ours.flat.clone()
            for index in range(len(ours.sizes)):
                start, size = 3 * sum(ours.sizes[:index]), ours.sizes[index]
                weights[start:start + size] = 2 * before.flat[start:start + size] - \
                    ours.flat[start:start + size]
            lie = FlatState(ours.version, ours.step, ours.names, ours.sizes, weights)
            reversed_caught.append(check_step(before, lie, train) is not None)
    mean = {key: sum(values) / len(values) for key, values in timings.items()}
    state_mib = sum(s.flat.numel() for s in pre) * 4 / 2**20
    figures = {
        "honest_max_threads": max(errors["threads"]), "honest_max_bf16": max(errors["bf16"]),
        "poisoned_min": min(errors["poisoned"]), "tolerance": tolerance,
        "reversed_caught": sum(reversed_caught) / len(reversed_caught),
        "step_s": mean["step"], "snapshot_s": mean["snapshot"], "replay_s": mean["replay"],
        "check_s": mean["check"], "state_mib": state_mib,
        "audit_cost_fraction": (mean["snapshot"] + fraction * (mean["replay"] + mean["check"]))
        / mean["step"],
    }
    common.print_table(
        f"training-peer audits: {args.model}, {args.stages} stages, {args.steps} steps",
        ["figure", "value"], list(figures.items()),
        caption=f"audit cost at train_audit_fraction={fraction}; an audit moves "
                f"4 x {state_mib:.1f} MiB through the coordinator")
    for name, (error, where) in worst.items():
        print(f"{name}: largest honest disagreement {error:.3g} at {where}")
    figures |= report_detection(detection, tolerance, args.rows)
    common.print_figures("train_audit", figures)
    if args.plot:
        plot(Path(args.plot), errors, tolerance, figures, fraction)


def report_detection(detection: dict[str, list[list[float]]], tolerance: float,
                     rows: int) -> dict[str, float]:
    """Print each poison's disagreement with the honest step and the share of stage audits that
    catch it (disagreement above the tolerance); return the smallest poison of each family
    caught by every audit (inf: none is)."""
    table = []
    caught_always: dict[str, bool] = {}
    for label, steps in detection.items():
        audits = [error for stages in steps for error in stages]
        caught = sum(error > tolerance for error in audits) / len(audits)
        caught_always[label] = caught == 1.0
        table.append([label, min(audits), max(audits), f"{caught:.0%}"])
    common.print_table(
        "training-peer audits: which poisons an audit catches",
        ["poison", "smallest disagreement", "largest", "stage audits caught"], table,
        caption=f"caught: the replay's disagreement (relative L2 of the step's gradient, worst "
                f"tensor) above the tolerance {tolerance}; every stage of every step audited")
    smallest_rows = min((count for count in range(1, rows + 1)
                         if caught_always.get(f"{count} of {rows} rows negated")),
                        default=math.inf)
    smallest_scale = min((factor for factor in SCALES
                          if caught_always[f"advantages x{factor:g}"]), default=math.inf)
    print(f"smallest poison every audit catches: {smallest_rows} of {rows} rows negated; "
          f"advantages x{smallest_scale:g}")
    return {"smallest_rows_negated_caught": float(smallest_rows),
            "smallest_scale_caught": smallest_scale}


def plot(path: Path, errors: dict[str, list[float]], tolerance: float,
         figures: dict[str, float], fraction: float) -> None:
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["fp32, 2x threads", "bf16 autocast", "poisoner (ascent)"]
    values = [errors["threads"], errors["bf16"], errors["poisoned"]]
    floor = 1e-6  # a log scale has no zero: bit-identical replays are drawn here
    for i, series in enumerate(values):
        left.scatter([i] * len(series), [max(value, floor) for value in series], alpha=0.7)
    left.axhline(tolerance, color="red", linestyle="--", label=f"tolerance {tolerance}")
    left.set_yscale("log")
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("gradient disagreement (rel. L2, worst tensor; 0 at 1e-6)")
    left.legend()
    left.set_title("calibration: honest replays vs a poisoned update")
    parts = {"snapshots (every step)": figures["snapshot_s"],
             f"replays (x{fraction})": fraction * figures["replay_s"],
             f"checks (x{fraction})": fraction * figures["check_s"]}
    right.bar(list(parts), [v / figures["step_s"] for v in parts.values()])
    right.set_ylabel("fraction of one training step's compute")
    right.set_title(f"audit cost: {figures['audit_cost_fraction']:.1%} of training")
    right.tick_params(axis="x", rotation=15)
    common.save_figure(figure, path)


if __name__ == "__main__":
    main()
