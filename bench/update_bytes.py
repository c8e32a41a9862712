"""Bytes per weight update against dense bf16 copies, and how faithfully replicas serve the
learner's weights with them.

Bytes per weight update against a dense bf16 copy of the weights, for full fine-tuning and for
LoRA, over real RL steps of the demo's model and task, for each update encoding asked for
(`--encodings`: `sync.selection/sync.values[@density]`).

Each variant runs the single-machine run (`local_run`, coordinator/local_backend.py) step by step
in synchronous mode: generate a batch of groups with the current weights, score them, take one
optimizer step.
After every step each stage publishes as a training peer does (sync/delta.py): the update is the
difference between its weights and the state it has published, top-k sparsified to `--density`
of each tensor's entries (each encoding publishes from the same learner, one published state
each), applied to the published state (error feedback).
Figures per step, encoding, and stage-summed:
- update bytes: the payload a replica downloads (msgpack: varint index gaps, int8 values, one
  float32 scale per 256 values);
- vs dense bf16: two bytes per parameter of the whole stage (what the swarm sent before), divided
  by the update bytes; targets: >= 50x (full fine-tuning), >= 500x (LoRA);
- gap: the share of the learner's movement not yet served, |learner - served| / |learner -
  start| over every published tensor, in bf16, what a replica serves (`served_fidelity`);
- bf16 differ: the fraction of entries whose served bf16 value differs from the learner's;
- KL: per token, KL(served || learner) of the full next-token distributions on the first
  `--kl-rows` rows of the step's batch, the served model (bf16 weights from the published state,
  as a replica holds them) against the learner (float32 weights under the trainer's autocast);
  `dense bf16` is the floor: the learner's weights cast to bf16, what a dense bf16 update serves;
- flagged: of those rows, the fraction whose mean per-token |log pi_learner - log pi_served| of
  the batch's tokens exceeds trust.flag_log_ratio: honest rows the trainer would flag from
  fidelity alone, without staleness;
- encode s: the publisher's CPU time to make the update (it runs on its own thread).

`full` trains every weight (lr 3e-5, the demo's); `lora` trains rank-`--lora-rank` adapters on
every projection (lr `--lora-lr`) and publishes only them.

Run: decentrl bench update-bytes [--model smollm2-135m-instruct|tiny] [--steps 6] [--batch 16]
     [--density 0.01] [--encodings magnitude/int8_delta,served_changes/bf16_value@0.006]
     [--kl-rows 8] [--lora-rank 8] [--variants full,lora] [--json PATH]"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, cast, get_args

import torch
from rich.console import Console

from bench import common
from decentrl.config import parse_config
from decentrl.coordinator.local_backend import copy_weights, local_run
from decentrl.demo import demo_config
from decentrl.learn.batch import TrainBatch
from decentrl.learn.stage_trainer import stage_forward
from decentrl.model.stages import StageModule
from decentrl.net.protocol import ServedFidelity
from decentrl.stage.replica import published_tensors
from decentrl.sync.delta import (
    SERVED_DTYPE,
    PublishedState,
    Selection,
    ValueFormat,
    apply_payload,
    encode_delta,
    payload_bytes,
    served_fidelity,
    state_hash,
)

VARIANTS = ("full", "lora")
DEFAULT_ENCODINGS = "magnitude/int8_delta,served_changes/int8_delta,served_changes/bf16_value," \
    "served_changes/bf16_value@0.006"


@dataclass(frozen=True)
class Encoding:
    """How updates are picked and sent (sync.selection, sync.values) at a density."""

    selection: Selection
    values: ValueFormat
    density: float

    @property
    def label(self) -> str:
        return f"{self.selection}/{self.values}@{self.density:g}"


def parse_encoding(text: str, density: float) -> Encoding:
    """`selection/values[@density]`, density defaulting to --density."""
    spec, _, given = text.partition("@")
    selection, _, values = spec.partition("/")
    if selection not in get_args(Selection) or values not in get_args(ValueFormat):
        raise ValueError(f"encoding {text!r}: expected selection/values[@density] with a "
                         f"selection in {get_args(Selection)} and values in "
                         f"{get_args(ValueFormat)}")
    chosen = float(given) if given else density
    if not 0 < chosen <= 1:
        raise ValueError(f"encoding {text!r}: density must be in (0, 1]")
    return Encoding(cast(Selection, selection), cast(ValueFormat, values), chosen)


def completion_logprobs(stages: list[StageModule], batch: TrainBatch) -> torch.Tensor:
    """Log-softmax of the next-token logits at every completion token [N, vocab], float32."""
    x: Any = (batch.prompts, batch.completions)
    with torch.no_grad():
        for stage in stages:
            x = stage_forward(stage, x, batch)
    return torch.log_softmax(x.float(), dim=-1)


def divergence(learner: torch.Tensor, served: torch.Tensor, batch: TrainBatch,
               flag_log_ratio: float) -> tuple[float, float]:
    """(KL(served || learner) per token, fraction of rows whose mean per-token |log-ratio| of
    the batch's own tokens exceeds `flag_log_ratio`)."""
    kl = (served.exp() * (served - learner)).sum(dim=-1)
    targets = batch.completions[batch.completion_valid]
    ratio = (learner.gather(1, targets[:, None]) - served.gather(1, targets[:, None]))[:, 0]
    rows = torch.nonzero(batch.completion_valid)[:, 0]
    counts = torch.bincount(rows, minlength=batch.num_sequences).clamp(min=1)
    row_ratio = torch.zeros(batch.num_sequences).index_add_(0, rows, ratio) / counts
    return float(kl.mean()), float((row_ratio.abs() > flag_log_ratio).float().mean())


def served_copy(stages: list[StageModule]) -> list[StageModule]:
    """Stages in the serving dtype, as a replica holds them."""
    return [copy.deepcopy(stage).to(SERVED_DTYPE) for stage in stages]


def load_served(models: list[StageModule], weights: list[dict[str, torch.Tensor]]) -> None:
    """Write float32 `weights` into served `models`, each entry cast as a replica's commit does."""
    for model, tensors in zip(models, weights, strict=True):
        params = model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)


def run_variant(variant: str, args: Any) -> dict[str, Any]:
    common.quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    encodings = [parse_encoding(text, args.density) for text in args.encodings]
    data = demo_config("sums")
    prompts = max(1, args.batch // 4)
    with tempfile.TemporaryDirectory(prefix="update-bytes-") as folder:
        data.update(name=f"update-bytes-{variant}", seed=args.seed,
                    model=common.bench_model(args.model), num_stages=args.stages)
        data["host"].update(run_dir=folder, device=args.device, dtype=args.dtype,
                            threads=args.threads or 0)
        data["rollout"].update(group_size=4, prompts_per_step=prompts)
        data["train"].update(mode="sync", steps=args.steps, zero_variance_groups="keep",
                             dynamic_sampling=False)
        if variant == "lora":
            data["train"].update(lora_rank=args.lora_rank, lr=args.lora_lr)
        config = parse_config(data)
        run = local_run(config, console=Console(quiet=True))
        flag_log_ratio = config.trust.flag_log_ratio or float("inf")
        stages = [t.stage for t in run.trainer.stage_trainers]
        start = [published_tensors(s) for s in stages]
        start = [{n: t.detach().float().cpu().clone() for n, t in s.items()} for s in start]
        published = {e.label: [PublishedState.of(0, s) for s in start] for e in encodings}
        served = {e.label: served_copy(stages) for e in encodings}
        dense_served = served_copy(stages)
        # The model's own weights: with LoRA, the stage without its adapters.
        dense_bf16 = sum(2 * p.numel() for stage, state in zip(stages, start)
                         for name, p in stage.state_dict().items()
                         if variant == "full" or name not in state)
        adapters_bf16 = sum(2 * t.numel() for state in start for t in state.values())
        rows = []
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            scored = []
            for group in run.worker.generate_groups(run.scheduler.next(prompts)):
                accepted = run.ingestion.ingest(group, run.trainer.version)
                if accepted is not None:
                    scored.append(accepted)
            batch, stats, _ = run.ingestion.make_batch(scored)
            if batch is not None:
                run.trainer.train_step(batch)
            copy_weights(stages, run.backend.chain)
            step_s = time.perf_counter() - started
            learner = [{n: t.detach().float().cpu() for n, t in published_tensors(s).items()}
                       for s in stages]
            sample = batch.select(slice(0, args.kl_rows)) if batch is not None else None
            learner_logprobs = None
            if sample is not None:
                with run.trainer.stage_trainers[0].autocast():
                    learner_logprobs = completion_logprobs(stages, sample)
                load_served(dense_served, learner)
                floor = divergence(learner_logprobs, completion_logprobs(dense_served, sample),
                                   sample, flag_log_ratio)
            for encoding in encodings:
                size, encode_s = 0, 0.0
                fidelity = ServedFidelity(unserved_square=0.0, moved_square=0.0, differing=0,
                                          entries=0)
                for stage, state, first, current in zip(stages, published[encoding.label],
                                                        start, learner):
                    began = common.cpu_seconds()
                    payload = encode_delta(state, current, encoding.density, encoding.selection,
                                           encoding.values)
                    data_bytes = payload_bytes(payload)
                    apply_payload(state, payload, stage.version)
                    state.hash = state_hash(state.tensors)
                    encode_s += common.cpu_seconds() - began
                    size += len(data_bytes)
                    measured = served_fidelity(current, state, first)
                    fidelity = ServedFidelity(
                        unserved_square=fidelity.unserved_square + measured.unserved_square,
                        moved_square=fidelity.moved_square + measured.moved_square,
                        differing=fidelity.differing + measured.differing,
                        entries=fidelity.entries + measured.entries)
                kl = flagged = floor_kl = floor_flagged = float("nan")
                if sample is not None and learner_logprobs is not None:
                    load_served(served[encoding.label],
                                [state.tensors for state in published[encoding.label]])
                    kl, flagged = divergence(learner_logprobs,
                                             completion_logprobs(served[encoding.label], sample),
                                             sample, flag_log_ratio)
                    floor_kl, floor_flagged = floor
                rows.append({"encoding": encoding.label, "step": step, "bytes": size,
                             "vs_dense_bf16": dense_bf16 / size if size else float("inf"),
                             "gap": fidelity.unserved_share,
                             "bf16_differing": fidelity.differing_fraction, "kl": kl,
                             "flagged": flagged, "floor_kl": floor_kl,
                             "floor_flagged": floor_flagged, "encode_s": encode_s,
                             "step_s": step_s, "accuracy": stats.get("accuracy", 0.0)})
                print(f"{variant} {encoding.label} step {step}: {size:,} bytes "
                      f"({rows[-1]['vs_dense_bf16']:.0f}x under dense bf16), gap "
                      f"{rows[-1]['gap']:.3f}, bf16 differ {rows[-1]['bf16_differing']:.4f}, "
                      f"KL {kl:.2e} (dense bf16 {floor_kl:.2e}), flagged {flagged:.3f}, "
                      f"encode {encode_s:.2f}s", flush=True)
    return {"variant": variant, "rows": rows, "dense_bf16_bytes": dense_bf16,
            "published_bf16_bytes": adapters_bf16,
            "published_params": sum(t.numel() for state in start for t in state.values()),
            "encodings": [e.label for e in encodings],
            "machine": common.machine(torch.device("cpu"))}


def report(results: list[dict[str, Any]], args: Any) -> None:
    figures = {}
    for result in results:
        variant = result["variant"]
        for label in result["encodings"]:
            rows = [r for r in result["rows"] if r["encoding"] == label]
            common.print_table(
                f"{variant}, {label}: bytes per update and fidelity "
                f"({result['published_params']:,} published parameters)",
                ["step", "update bytes", "vs dense bf16", "gap", "bf16 differ", "KL",
                 "KL dense bf16", "flagged", "encode s"],
                [[r["step"], r["bytes"], r["vs_dense_bf16"], r["gap"], r["bf16_differing"],
                  r["kl"], r["floor_kl"], r["flagged"], r["encode_s"]] for r in rows],
                caption=f"dense bf16 of every stage: {result['dense_bf16_bytes']:,} bytes; of "
                        f"the published tensors alone: {result['published_bf16_bytes']:,} bytes")
            mean_bytes = statistics.fmean(r["bytes"] for r in rows)
            key = f"{variant}_{label}"
            figures[f"{key}_bytes"] = mean_bytes
            figures[f"{key}_vs_dense_bf16"] = result["dense_bf16_bytes"] / mean_bytes
            figures[f"{key}_gap_last"] = rows[-1]["gap"]
            figures[f"{key}_bf16_differing_mean"] = statistics.fmean(
                r["bf16_differing"] for r in rows)
            figures[f"{key}_kl_mean"] = statistics.fmean(r["kl"] for r in rows)
            figures[f"{key}_flagged_mean"] = statistics.fmean(r["flagged"] for r in rows)
        figures[f"{variant}_dense_bf16_kl_mean"] = statistics.fmean(
            r["floor_kl"] for r in result["rows"])
    common.print_figures("update-bytes", figures)
    print(results[0]["machine"])
    common.write_json(args.json, {"figures": figures, "results": results})


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(
        "decentrl bench update-bytes", __doc__, "RL step",
        {"steps": "RL steps (one update each) per variant", "warmup": "unused here",
         "batch": "sequences per step (groups of 4)"})
    parser.add_argument("--density", type=float, default=0.01,
                        help="fraction of each tensor's entries an update carries, for the "
                             "encodings that name none")
    parser.add_argument("--encodings", type=lambda s: s.split(","),
                        default=DEFAULT_ENCODINGS.split(","),
                        help="sync.selection/sync.values[@density], comma separated")
    parser.add_argument("--kl-rows", type=int, default=8,
                        help="rows of each step's batch the KL and flag rate are measured on")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if args.kl_rows < 1:
        parser.error(f"--kl-rows must be >= 1, got {args.kl_rows}")
    try:
        for text in args.encodings:
            parse_encoding(text, args.density)
    except ValueError as error:
        parser.error(str(error))
    common.run_variants(__spec__.name, argv, args, run_variant, report)


if __name__ == "__main__":
    main()
