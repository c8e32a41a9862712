"""Helpers shared by the benches: device sync, timing with warm-up, peak memory, running one
variant in a fresh process (so a CPU peak RSS belongs to that variant alone), and printing.

Each bench is a module of this package (`python -m bench.NAME` from the checkout root, or
`decentrl bench NAME`, which imports `bench.NAME` and calls `main(argv)`) and imports this one as
`from bench import common`."""

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from decentrl.coordinator.loop import RunHooks, TrainingLoop
from decentrl.coordinator.pool import POLL_S
from decentrl.evaluate.runner import EvalResult

if TYPE_CHECKING:
    from decentrl.client.sessions import RemoteChain
    from decentrl.config import RunConfig
    from decentrl.launch.local_swarm import LocalSwarm
    from decentrl.model.spec import ModelSpec
    from decentrl.net.directory import Directory

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


def processes_cpu_seconds(pids: Sequence[int]) -> float | None:
    """CPU time (user + system, all threads) the processes `pids` (this machine's, e.g. a bench's
    peers) have used so far, from /proc; None where /proc has no such process (not Linux)."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        # After "pid (command)" come the fields from the third on; utime and stime are the
        # 14th and 15th (proc(5)). The command may hold spaces, hence the split at its ")".
        fields = stat.rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


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


def run_worker(module: str, argv: list[str]) -> dict[str, Any]:
    """Run `python -m module argv` in a fresh Python process and return the dict it emitted with
    `emit_result`. Its other output passes through, so progress and errors stay visible."""
    env = dict(os.environ)
    # The bench package lives in the checkout root (no wheel ships it), and the worker may start
    # in any folder; src/ comes along so the worker measures this checkout's decentrl.
    checkout = Path(__file__).resolve().parents[1]
    paths = (str(checkout), str(checkout / "src"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    process = subprocess.run([sys.executable, "-m", module, *argv], env=env, text=True,
                             stdout=subprocess.PIPE, check=False)
    result = None
    for line in process.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        else:
            print(line)
    if process.returncode != 0 or result is None:
        raise RuntimeError(f"bench worker {module} {' '.join(argv)} failed "
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
    from decentrl.demo import demo_config

    agentic_task = demo_config("agentic-calculator")["task"]

    parser.add_argument("--env", default=agentic_task["name"], help="an agentic environment")
    parser.add_argument("--options", default=json.dumps(agentic_task["options"]),
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


def run_variants(module: str, argv: list[str] | None, args: Any,
                 run_variant: Any, report: Any) -> None:
    """A bench's main: as a worker, run the one variant asked for and emit its result; otherwise
    run every variant (each in its own process, `python -m module`, unless --in-process) and
    report them together. `module` is the bench's own `__spec__.name`, such as bench.generation
    (its `__name__` is __main__ under `python -m`)."""
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
            results.append(run_worker(module, [*forwarded, "--worker", variant]))
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
    """Training-loop hooks (coordinator/loop.py) that hold new generation while an evaluation runs,
    so that a variant gets no generation done off its clock (a group already in flight finishes).
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


def sums_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The first `count` training prompts of the sums task, as token ids."""
    from decentrl.tasks import make_task, problems, render_prompt

    task = make_task("sums")
    return [render_prompt(task, p, tokenizer) for p in problems(task, "train", count)]


def hf_generation_model(folder: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """Hugging Face's `AutoModelForCausalLM` from a model folder, in `dtype`, made to ignore
    end-of-sequence: `generate()` fills every unset (None) field of its config from
    `model.generation_config`, eos included, so eos_token_id=None in `hf_generate` only sticks
    once the model's own default is gone too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model: Any, prompts: list[list[int]], pad_id: int, max_new_tokens: int,
                sample: bool, seed: int) -> list[list[int]]:
    """Exactly `max_new_tokens` new tokens per prompt (left-padded, one batch) from a
    `hf_generation_model`: sampled at temperature 1 with no top-k/top-p cut, seeded by `seed`,
    or greedy."""
    from transformers import GenerationConfig

    from decentrl.rollout.generate import left_pad

    ids, valid = left_pad(prompts, pad_id, model.device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=1.0,
                              top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=pad_id)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=valid.long(), generation_config=config)
    new = out[:, ids.shape[1]:]
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"HF generated {new.shape[1]} tokens per row, expected "
                           f"{max_new_tokens}: it stopped early")
    return new.cpu().tolist()


def drive_sessions(pool: ThreadPoolExecutor, chain: Any, prompt_sets: list[list[list[int]]],
                   steps: int, max_new_tokens: int, pad_id: int, seed: int,
                   peer_pids: Sequence[int] = ()) -> dict[str, float]:
    """One concurrency level: len(prompt_sets) sessions on as many threads of `pool`, each calling
    `generate` `steps` times on its own prompts (sampled at temperature 1, no stop ids, so every
    row decodes exactly `max_new_tokens`); returns the level's wall and CPU time (and the CPU time
    of the `peer_pids` processes, where /proc tells), new tokens and per-generation times. The
    pool's threads live for the whole sweep: a thread's first parallel torch call sets up its own
    CPU thread team, which the warm-up pays once for every thread."""
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig

    sampling = SamplingConfig(temperature=1.0)
    concurrency = len(prompt_sets)
    # Every session waits here until all have started: `concurrency` distinct threads, one start.
    start = threading.Barrier(concurrency + 1)
    seconds: list[float] = []

    def session(index: int) -> int:
        start.wait()
        tokens = 0
        for step in range(steps):
            began = time.perf_counter()
            out = generate(chain, prompt_sets[index], max_new_tokens, sampling, set(), pad_id,
                           seed * 1_000_003 + index * 1_009 + step)
            seconds.append(time.perf_counter() - began)
            tokens += sum(len(g.tokens) for g in out)
        return tokens

    futures = [pool.submit(session, i) for i in range(concurrency)]
    start.wait(timeout=600)
    began, began_cpu = time.perf_counter(), cpu_seconds()
    began_peers = processes_cpu_seconds(peer_pids)
    new_tokens = sum(future.result() for future in futures)
    wall, cpu = time.perf_counter() - began, cpu_seconds() - began_cpu
    ended_peers = processes_cpu_seconds(peer_pids)
    expected = concurrency * steps * len(prompt_sets[0]) * max_new_tokens
    if new_tokens != expected:
        raise RuntimeError(f"{new_tokens} new tokens, expected {expected}")
    level = {"concurrency": concurrency, "new_tokens": new_tokens, "wall_s": wall, "cpu_s": cpu,
             "tokens_per_s": new_tokens / wall,
             "generation_s_mean": sum(seconds) / len(seconds), "generation_s_max": max(seconds)}
    if peer_pids and began_peers is not None and ended_peers is not None:
        level["peer_cpu_s"] = ended_peers - began_peers
    return level


def sweep_sessions(chain: Any, prompts: list[list[int]], args: Any, pad_id: int,
                   label: str, peer_pids: Sequence[int] = ()) -> list[dict[str, float]]:
    """`drive_sessions` at every level of `args.concurrency`, each session `args.batch` prompts,
    after `args.warmup` untimed rounds at the largest level (every session thread, and in a swarm
    every replica, runs once)."""
    batch, most = args.batch, max(args.concurrency)
    sets = [prompts[i * batch:(i + 1) * batch] for i in range(most)]
    levels = []
    with ThreadPoolExecutor(max_workers=most, thread_name_prefix="session") as pool:
        for _ in range(args.warmup):
            drive_sessions(pool, chain, sets, 1, args.max_new_tokens, pad_id, args.seed + 1)
        for concurrency in args.concurrency:
            level = drive_sessions(pool, chain, sets[:concurrency], args.steps,
                                   args.max_new_tokens, pad_id, args.seed, peer_pids)
            peers = f", peers' CPU {level['peer_cpu_s']:.2f} s" if "peer_cpu_s" in level else ""
            print(f"  {label} concurrency {concurrency:3d}: {level['tokens_per_s']:8.1f} new "
                  f"tok/s ({level['wall_s']:.2f} s, {level['generation_s_mean']:.2f} s per "
                  f"generation{peers})", flush=True)
            levels.append(level)
    return levels


def inference_swarm_config(name: str, folder: Path, model: Path, args: Any,
                           swarm: dict[str, Any], host: dict[str, Any] | None = None
                           ) -> RunConfig:
    """The run config of a generation bench's swarm, in `folder`: `args`' stages, device, dtype,
    threads (per peer) and seed, `swarm` and `host` (more `swarm.*` and `host.*` settings), and
    session caps that let the bench's one client hold all of `args.concurrency`'s sessions on a
    peer at once."""
    from decentrl.config import parse_config

    sessions = max(32, 2 * max(args.concurrency))
    return parse_config({
        "name": name, "model": str(model), "num_stages": args.stages, "seed": args.seed,
        "host": {"run_dir": str(folder / "runs"), "device": args.device, "dtype": args.dtype,
                 "threads": args.threads or 0, **(host or {})},
        "swarm": {"announce_every_s": 60.0, "request_timeout_s": 120.0,
                  "max_sessions_per_peer": sessions, "max_sessions_per_sender": sessions,
                  **swarm},
    })


@contextmanager
def inference_swarm(config: RunConfig, spec: ModelSpec
                    ) -> Iterator[tuple[LocalSwarm, RemoteChain]]:
    """`config.swarm.inference_replicas` inference peers per stage, each a `decentrl join`
    process on loopback joining with `config`, and a `RemoteChain` through them whose client is
    this process's bootstrap node (it carries `config.host.link`); shut down on the way out."""
    from decentrl.client.sessions import RemoteChain
    from decentrl.launch.local_swarm import LocalSwarm
    from decentrl.net.directory import Directory

    config_path = fresh_swarm_folder(config)
    replicas = config.swarm.inference_replicas
    swarm = LocalSwarm(config, config_path, replicas, training=False)
    try:
        started = time.perf_counter()
        swarm.start()
        assert swarm.bootstrap is not None
        print(f"  {len(swarm.children)} peers up in {time.perf_counter() - started:.0f}s: "
              + "; ".join(swarm.layout()), flush=True)
        directory = Directory(swarm.bootstrap, config.name, config.num_stages, config.swarm)
        wait_for_peers(directory, replicas)
        yield swarm, RemoteChain(swarm.bootstrap, directory, config.swarm, config.trust, spec)
    finally:
        swarm.shutdown()


def peer_pids(swarm: LocalSwarm) -> list[int]:
    return [child.process.pid for child in swarm.children.values() if child.process is not None]


def wait_for_peers(directory: Directory, replicas: int, timeout_s: float = 60.0) -> None:
    """Until every stage has announced `replicas` peers (TimeoutError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        directory.refresh()
        if all(len(records) >= replicas for records in directory.stage_summary()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every stage announced {replicas} replicas within "
                               f"{timeout_s:.0f}s")
        time.sleep(0.5)
