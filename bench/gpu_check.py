"""GPU check: on a machine with CUDA, the model conformance, a training run and a local swarm on
the GPU, with absolute figures; on one without, a clear refusal.

`make gpu-check` runs it, as one prepared script, in three parts:
  1. conformance: every registered family's tiny conformance model (tests/unit/model/families)
     built by our stages on the GPU in fp32 (TF32 off) at 1, 2 and 4 stages, against
     transformers' logits on the CPU; each max relative difference must be under 1e-4 (the
     CPU tests hold 1e-5: a GPU's kernels reduce in another order);
  2. training: `decentrl bench trainer-throughput --device cuda` (SmolLM2-135M, 2 stages,
     fp32 master weights under bf16 autocast, 3 timed steps): tokens/s, a step's time, peak
     GPU memory;
  3. a local swarm whose peers compute on the GPU: `decentrl bench swarm-generation --device
     cuda --stages 2 --concurrency 1,8 --variants swarm,batched --batching on`: new tokens/s
     against one batched Hugging Face generate on the same GPU.
It prints every figure and ends with one line, `gpu_check ...`; it exits non-zero if a part
fails. Without CUDA it says so and exits 2 before anything runs."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common

TOLERANCE = 1e-4
STAGES = (1, 2, 4)


def refuse_without_cuda() -> None:
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        print(f"gpu-check needs a CUDA GPU, and torch {torch.__version__} sees none (its CUDA: "
              f"{built}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch; "
              "on this machine, `make test` covers the same code on the CPU.", file=sys.stderr)
        raise SystemExit(2)


def conformance() -> dict[str, float]:
    """Each family's worst relative difference on the GPU (raises past TOLERANCE)."""
    from decentrl.model.blocks import positions_from_valid
    from decentrl.model.stages import StagePlan, build_stages
    from tests.unit.model.families.cases import family_cases
    from tests.unit.model.families.conformance import build_family, relative_difference

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cuda = torch.device("cuda")
    worst: dict[str, float] = {}
    failures = []
    with tempfile.TemporaryDirectory(prefix="decentrl-gpu-") as folder:
        for case in family_cases():
            family = build_family(case, Path(folder) / str(case))
            spec = family.model.spec
            ids, valid = family.ids.to(cuda), family.valid.to(cuda)
            positions = positions_from_valid(valid)
            differences = []
            for num_stages in STAGES:
                stages = build_stages(spec, StagePlan.even(spec.num_layers, num_stages),
                                      family.model.tensors, cuda, torch.float32)
                with torch.no_grad():
                    x = ids
                    for stage in stages:
                        x = stage(x, positions, valid)
                differences.append(relative_difference(x[valid].cpu(),
                                                       family.expected[family.valid]))
            worst[str(case)] = max(differences)
            status = "ok" if worst[str(case)] <= TOLERANCE else "FAILED"
            print(f"  {case}: worst relative difference {worst[str(case)]:.1e} over "
                  f"{', '.join(map(str, STAGES))} stages: {status}", flush=True)
            if worst[str(case)] > TOLERANCE:
                failures.append(str(case))
    if failures:
        raise SystemExit(f"conformance on the GPU failed for {failures} (tolerance "
                         f"{TOLERANCE:g})")
    return worst


def figures_of(command: list[str], name: str) -> dict[str, str]:
    """Run a bench (it prints its table) and return its `NAME key=value ...` line's figures."""
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", *command], text=True,
                               capture_output=True, check=False)
    print(completed.stdout, end="", flush=True)
    if completed.returncode != 0:
        print(completed.stderr, file=sys.stderr)
        raise SystemExit(f"{' '.join(command)} failed (exit {completed.returncode})")
    line = next((line for line in completed.stdout.splitlines()
                 if line.startswith(f"{name} ")), "")
    figures = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
    print(f"  ({time.perf_counter() - started:.0f}s)", flush=True)
    return figures


def main(argv: list[str] | None = None) -> None:
    refuse_without_cuda()
    properties = torch.cuda.get_device_properties(0)
    print(f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB; torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    print("1. conformance on the GPU", flush=True)
    worst = conformance()
    print("2. training on the GPU", flush=True)
    training = figures_of(["bench.trainer_throughput", "--device", "cuda", "--steps", "3",
                           "--variants", "decentrl"], "trainer_throughput")
    print("3. a local swarm on the GPU", flush=True)
    swarm = figures_of(["bench.swarm_generation", "--device", "cuda", "--stages", "2",
                        "--concurrency", "1,8", "--variants", "swarm,batched",
                        "--batching", "on", "--plot", "none"], "swarm_generation")
    summary = {"families": float(len(worst)), "worst_difference": max(worst.values()),
               **{f"train_{k}": float(v) for k, v in training.items()},
               **{f"swarm_{k}": float(v) for k, v in swarm.items()}}
    common.print_figures("gpu_check", summary)


if __name__ == "__main__":
    main()
