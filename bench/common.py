"""Helpers shared by the benches: device sync, timing with warm-up, peak memory, running one
variant in a fresh process (so a CPU peak RSS belongs to that variant alone), and printing.

Benches are plain scripts (`python bench/NAME.py`, or `decentrl bench NAME`, which imports the
file by path and calls `main(argv)`); they put this folder on sys.path to import this module."""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from decentrl.evaluate.runner import EvalResult
from decentrl.swarm.loop import POLL_S, RunHooks, TrainingLoop

RESULT_PREFIX = "BENCH_RESULT "


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """(peak MiB, what it measures). CUDA: peak allocated by torch since the last reset. MPS:
    memory the Metal driver holds now (no peak counter exists). CPU: peak resident set size of
    this process since it started, which is why benches run each variant in its own process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max allocated"
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 2**20, "mps driver allocated (now)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return (rss / 2**20 if sys.platform == "darwin" else rss / 2**10), "process peak RSS"


def cpu_seconds() -> float:
    """CPU time (user + system, all threads) this process has used: unlike wall time it barely
    grows when other processes compete for the cores, so it is the steadier figure on a shared
    machine (it does include threads spinning while they wait for work)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int
               ) -> dict[str, list[float]]:
    """Wall-clock and CPU seconds of `repeats` calls of `fn` after `warmup` untimed ones:
    {"wall": [...], "cpu": [...]}."""
    for _ in range(warmup):
        fn()
    sync(device)
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        fn()
        sync(device)
        wall.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    return {"wall": wall, "cpu": cpu}


def summary(timings: dict[str, list[float]]) -> dict[str, float]:
    wall, cpu = timings["wall"], timings["cpu"]
    return {"mean_s": statistics.fmean(wall), "min_s": min(wall),
            "stdev_s": statistics.stdev(wall) if len(wall) > 1 else 0.0,
            "cpu_mean_s": statistics.fmean(cpu)}


def machine(device: torch.device) -> str:
    """One line naming the hardware and software the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [(f"{cpu} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
              f"cpu capability {torch.backends.cpu.get_cpu_capability()})")]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    elif device.type == "mps":
        parts.append("Apple MPS")
    parts.append(f"torch {torch.__version__}")
    try:
        import transformers
        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    return "; ".join(parts)


def quiet_transformers() -> None:
    """No loading progress bars or advisory warnings in bench output."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_worker(script: Path, argv: list[str]) -> dict[str, Any]:
    """Run `script argv` in a fresh Python process and return the dict it emitted with
    `emit_result`. Its other output passes through, so progress and errors stay visible."""
    env = dict(os.environ)
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH")) if p)
    process = subprocess.run([sys.executable, str(script), *argv], env=env, text=True,
                             stdout=subprocess.PIPE, check=False)
    result = None
    for line in process.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        else:
            print(line)
    if process.returncode != 0 or result is None:
        raise RuntimeError(f"bench worker {script.name} {' '.join(argv)} failed "
                           f"(exit code {process.returncode})")
    return result


def variant_setup(args: Any) -> tuple[Any, torch.device, torch.dtype]:
    """What a variant worker starts with, from the shared options: quiet transformers, `--threads`,
    the device and dtype, and the loaded `--model` (`bench_model`: `tiny` works too)."""
    from decentrl.device import compute_dtype, pick_device
    from decentrl.model.loading import load_model

    quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    return load_model(bench_model(args.model)), device, compute_dtype(device, args.dtype)


def emit_result(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def bench_parser(prog: str, doc: str | None, unit: str,
                 meanings: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The options every bench shares; the description is the first paragraph of the bench's
    `doc`, `unit` names what one timed repeat is, `meanings` gives a shared option (by its dest)
    the help text of what it means in this bench."""
    from decentrl.model.loading import DEFAULT_MODEL

    description = " ".join((doc or "").split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, HF folder, or tiny (a tiny random model, for smoke runs)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32", "fp16"),
                        help="compute dtype (auto: decentrl.device.compute_dtype)")
    parser.add_argument("--steps", type=int, default=3, help=f"timed {unit}s per variant")
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {unit}s first")
    parser.add_argument("--batch", type=int, default=16, help=f"sequences per {unit}")
    parser.add_argument("--stages", type=int, default=2, help="decentrl pipeline stages")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process", action="store_true",
                        help="run every variant in this process (CPU peak RSS is then shared)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile one extra {unit} per variant and print the top operators")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    unknown = set(meanings or {}) - {action.dest for action in parser._actions}
    if unknown:
        raise ValueError(f"no shared bench options named {sorted(unknown)}")
    for action in parser._actions:
        if meanings and action.dest in meanings:
            action.help = meanings[action.dest]
    return parser


def add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    """`--env` and `--options` of a bench over an agentic environment (default: the agentic
    demo's); `parse_environment_options` reads `--options` once parsed."""
    from decentrl.demo import AGENTIC_TASK

    parser.add_argument("--env", default=AGENTIC_TASK["name"], help="an agentic environment")
    parser.add_argument("--options", default=json.dumps(AGENTIC_TASK["options"]),
                        help="the environment's options, a JSON object (default: the demo's)")


def parse_environment_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Replace `args.options` (JSON text) by the object it holds; a parser error if it is not
    a JSON object."""
    try:
        args.options = json.loads(args.options)
    except json.JSONDecodeError as error:
        parser.error(f"--options is not JSON: {error}")
    if not isinstance(args.options, dict):
        parser.error("--options must be a JSON object")


def run_variants(script: Path, argv: list[str] | None, args: Any,
                 run_variant: Any, report: Any) -> None:
    """A bench's main: as a worker, run the one variant asked for and emit its result; otherwise
    run every variant (each in its own process unless --in-process) and report them together."""
    if args.worker:
        emit_result(run_variant(args.worker, args))
        return
    results = []
    for variant in args.variants:
        print(f"running {variant} ...", flush=True)
        if args.in_process:
            results.append(run_variant(variant, args))
        else:
            forwarded = [a for a in (argv if argv is not None else sys.argv[1:])
                         if a != "--in-process"]
            results.append(run_worker(script, [*forwarded, "--worker", variant]))
    report(results, args)


def profile(fn, device: torch.device, label: str, rows: int = 25) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n--- profile of one {label} step (sorted by {sort}) ---")
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                caption: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(format_value(v) for v in row))
    Console(width=max(120, len(title) + 4)).print(table)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def print_figures(name: str, figures: dict[str, float]) -> None:
    """One machine-readable line: `name key=value ...` (the smoke test reads these)."""
    print(name + " " + " ".join(f"{key}={value:.6g}" for key, value in figures.items()),
          flush=True)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def bench_model(name: str) -> str:
    """The model a bench runs, as a config names it: for `tiny`, the folder of a tiny random
    model (quick smoke runs); any other name (a model name or Hugging Face folder) as it is,
    resolved here first, so that a wrong one fails before anything starts and the default model
    is converted from its GGUF once, before the peers a bench starts race to convert it."""
    from decentrl.model.loading import resolve_model

    if name == "tiny":
        return str(tiny_model_folder())
    resolve_model(name)
    return name


@functools.cache
def tiny_model_folder() -> Path:
    """A tiny random model (decentrl.model.tiny) written once per process into a folder removed
    when the process exits. Its seed is fixed, so every process that writes one (each variant
    worker) gets the same weights."""
    from decentrl.model.tiny import make_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="decentrl-bench-tiny-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return make_tiny_model(folder / "model", seed=0)


def fresh_swarm_folder(config: Any) -> Path:
    """Empty the run folder of `config` (a RunConfig) and write the config peers join with into
    it; returns that file's path."""
    shutil.rmtree(config.path, ignore_errors=True)
    config.path.mkdir(parents=True)
    path = config.path / "swarm-config.json"
    path.write_text(config.model_dump_json(indent=2))
    return path


def save_figure(figure: Any, path: Path) -> None:
    """Write a matplotlib figure as a PNG (creating its folder) and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot: {path}")


class GenerationHeldDuringEvaluation(RunHooks):
    """Training-loop hooks (swarm/loop.py) that hold new generation while an evaluation runs, so
    that a variant gets no generation done off its clock (a group already in flight finishes).
    Subclasses that override the evaluation hooks call these too."""

    def __init__(self) -> None:
        self.generation_open = threading.Event()
        self.generation_open.set()

    def before_generation(self, loop: TrainingLoop, stop: threading.Event) -> bool:
        while not self.generation_open.wait(POLL_S):
            if stop.is_set():
                return False
        return True

    def before_evaluation(self, loop: TrainingLoop, label: str) -> None:
        self.generation_open.clear()

    def after_evaluation(self, loop: TrainingLoop, label: str, result: EvalResult) -> None:
        self.generation_open.set()
