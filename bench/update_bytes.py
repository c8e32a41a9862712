"""Bytes per weight update against dense bf16 copies.

Bytes per weight update against a dense bf16 copy of the weights, for full fine-tuning and for
LoRA, over real RL steps of the demo's model and task.

Each variant runs the single-machine run (`LocalRun`, swarm/run.py) step by step in synchronous
mode: generate a batch of groups with the current weights, score them, take one optimizer step.
After every step each stage publishes as a training peer does (sync/delta.py): the update is the
difference between its weights and the state it has published, top-k sparsified to `--density`
of each tensor's entries with int8 values, applied to the published state (error feedback).
Figures per step and stage-summed:
- update bytes: the payload a replica downloads (msgpack: varint index gaps, int8 values, one
  float32 scale per 256 values);
- vs dense bf16: two bytes per parameter of the whole stage (what the swarm sent before), divided
  by the update bytes; targets: >= 50x (full fine-tuning), >= 500x (LoRA);
- gap: how far the replicas' weights are from the trainer's, |trainer - published| / |trainer -
  start| over every published tensor (error feedback keeps it bounded; 0 is exact);
- encode s: the publisher's CPU time to make the update (it runs on its own thread).

`full` trains every weight (lr 3e-5, the demo's); `lora` trains rank-`--lora-rank` adapters on
every projection (lr `--lora-lr`) and publishes only them.

Run: decentrl bench update-bytes [--model smollm2-135m-instruct|tiny] [--steps 6] [--batch 16]
     [--density 0.01] [--lora-rank 8] [--variants full,lora] [--json PATH]"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from decentrl.config import parse_config  # noqa: E402
from decentrl.demo import demo_config  # noqa: E402
from decentrl.swarm.local import copy_weights, local_run  # noqa: E402
from decentrl.swarm.replica import published_tensors  # noqa: E402
from decentrl.sync.delta import (  # noqa: E402
    PublishedState,
    apply_payload,
    encode_delta,
    payload_bytes,
    state_hash,
)

VARIANTS = ("full", "lora")


def stage_gap(current: dict[str, torch.Tensor], published: PublishedState,
              start: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(squared norm of trainer - published, squared norm of trainer - start)."""
    missing = moved = 0.0
    for name, value in current.items():
        value = value.detach().float().cpu()
        missing += float((value - published.tensors[name]).pow(2).sum())
        moved += float((value - start[name]).pow(2).sum())
    return missing, moved


def run_variant(variant: str, args: Any) -> dict[str, Any]:
    common.quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = demo_config("sums")
    prompts = max(1, args.batch // 4)
    with tempfile.TemporaryDirectory(prefix="update-bytes-") as folder:
        data.update(name=f"update-bytes-{variant}", run_dir=folder, seed=args.seed,
                    model=common.bench_model(args.model), num_stages=args.stages,
                    device=args.device, dtype=args.dtype, threads=args.threads)
        data["rollout"].update(group_size=4, prompts_per_step=prompts)
        data["train"].update(mode="sync", steps=args.steps, zero_variance_groups="keep")
        if variant == "lora":
            data["train"].update(lora_rank=args.lora_rank, lr=args.lora_lr)
        run = local_run(parse_config(data), console=Console(quiet=True))
        stages = [t.stage for t in run.trainer.stage_trainers]
        published = [PublishedState.of(0, published_tensors(s)) for s in stages]
        start = [{n: t.clone() for n, t in p.tensors.items()} for p in published]
        # The model's own weights: with LoRA, the stage without its adapters.
        dense_bf16 = sum(2 * p.numel() for stage, state in zip(stages, published)
                         for name, p in stage.state_dict().items()
                         if variant == "full" or name not in state.tensors)
        adapters_bf16 = sum(2 * p.numel() for p in published)
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
            size, encode_s, missing, moved = 0, 0.0, 0.0, 0.0
            for stage, state, first in zip(stages, published, start):
                current = published_tensors(stage)
                began = common.cpu_seconds()
                payload = encode_delta(state, current, args.density)
                data_bytes = payload_bytes(payload)
                apply_payload(state, payload, stage.version)
                state.hash = state_hash(state.tensors)
                encode_s += common.cpu_seconds() - began
                size += len(data_bytes)
                gap = stage_gap(current, state, first)
                missing, moved = missing + gap[0], moved + gap[1]
            rows.append({"step": step, "bytes": size, "vs_dense_bf16": dense_bf16 / size,
                         "gap": (missing / moved) ** 0.5 if moved > 0 else 0.0,
                         "encode_s": encode_s, "step_s": step_s,
                         "accuracy": stats.get("accuracy", 0.0)})
            print(f"{variant} step {step}: {size:,} bytes ({dense_bf16 / size:.0f}x under dense "
                  f"bf16), gap {rows[-1]['gap']:.3f}, encode {encode_s:.2f}s", flush=True)
    return {"variant": variant, "rows": rows, "dense_bf16_bytes": dense_bf16,
            "published_bf16_bytes": adapters_bf16,
            "published_params": sum(p.numel() for p in published),
            "machine": common.machine(torch.device("cpu"))}


def report(results: list[dict[str, Any]], args: Any) -> None:
    for result in results:
        rows = result["rows"]
        common.print_table(
            f"{result['variant']}: bytes per update (density {args.density}, "
            f"{result['published_params']:,} published parameters)",
            ["step", "update bytes", "vs dense bf16", "gap", "encode s"],
            [[r["step"], r["bytes"], r["vs_dense_bf16"], r["gap"], r["encode_s"]] for r in rows],
            caption=f"dense bf16 of every stage: {result['dense_bf16_bytes']:,} bytes; of the "
                    f"published tensors alone: {result['published_bf16_bytes']:,} bytes")
    figures = {}
    for result in results:
        rows = result["rows"]
        mean_bytes = statistics.fmean(r["bytes"] for r in rows)
        figures[f"{result['variant']}_bytes"] = mean_bytes
        figures[f"{result['variant']}_vs_dense_bf16"] = result["dense_bf16_bytes"] / mean_bytes
        figures[f"{result['variant']}_gap_last"] = rows[-1]["gap"]
    common.print_figures("update-bytes", figures)
    print(results[0]["machine"])
    common.write_json(args.json, {"figures": figures, "results": results})


def main(argv: list[str] | None = None) -> None:
    parser = common.bench_parser(
        "decentrl bench update-bytes", __doc__, "RL step",
        {"steps": "RL steps (one update each) per variant", "warmup": "unused here",
         "batch": "sequences per step (groups of 4)"})
    parser.add_argument("--density", type=float, default=0.01,
                        help="fraction of each tensor's entries an update carries")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    args = parser.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    common.run_variants(Path(__file__), argv, args, run_variant, report)


if __name__ == "__main__":
    main()
