"""Swarm generation tokens/s as sessions in flight grow.

Generation throughput (new tokens/s) through a swarm of stage peers with an emulated round trip
on every hop, against the same generation in one process, as the number of concurrent sessions
grows.

What runs:
- `swarm`: `--stages` stages, `--replicas` inference peers per stage (default 1), each peer a
  separate `decentrl join` process on loopback holding only its stage's layers, `--threads` torch
  threads per peer (default 1). The bench process is the client: its SwarmNode carries the
  emulated link (`LinkProfile(rtt_ms=(R, R))`, `--rtt-ms` R = 100 by default; the emulator sits on
  the caller's side of every hop, and in the swarm the client calls every stage itself, so every
  hop of every decoding step costs R). It drives C concurrent sessions (`--concurrency`, default
  1,2,4,8,16), each a Python thread calling `generate` on one shared `RemoteChain` with its own
  batch of `--batch` B sums prompts. Activations travel with `--codec` (default bf16, the swarm's
  default).
- `local`: the same C threads, prompts and seeds calling `generate` on a `LocalChain` of the same
  stages in one process: no network, no latency.

Fair amount of work: no stop ids, so every row decodes exactly `--max-new-tokens` T tokens on both
sides; one concurrency level decodes C x `--steps` x B x T new tokens; tokens/s is that over the
wall time from releasing the C threads to the last one finishing, after `--warmup` untimed rounds
in which every session thread generates once (the threads are reused across levels). The ratio
swarm / local per level is the figure: the target is >= 0.70 at enough concurrency. A decoding
step of one session cannot take less than stages x R (its hops are sequential), so one session is
bounded by B / (stages x R) tokens/s whatever the compute ("latency bound" column); concurrency is
what hides the latency: while one session waits on the network, the peers compute the others.

On a CPU-only machine the peers and the local baseline share the same cores, so the ratio does not
measure added hardware: it measures whether the swarm hides its latency and RPC overhead with
concurrency. To keep the comparison level, the local baseline gets the same total thread count as
all peers together (stages x replicas x threads), and the swarm's client process (which only
relays) runs 1 thread. Each peer computes one request at a time (its node's single compute
thread), so C sessions are served in turn by every peer, while the local chain runs the C threads'
forward passes side by side. Each variant runs in its own process (`--in-process`: both in this
one).

Run: decentrl bench swarm-generation [--model smollm2-135m-instruct|tiny|PATH] [--stages 2]
     [--replicas 1] [--threads 1] [--rtt-ms 100] [--batch 8] [--max-new-tokens 32]
     [--concurrency 1,2,4,8,16] [--steps 1] [--codec bf16] [--plot PATH|none] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from decentrl.config import parse_config  # noqa: E402
from decentrl.swarm.launch import LocalSwarm  # noqa: E402

VARIANTS = ("local", "swarm")
CODECS = ("fp32", "bf16", "int8")
TARGET_RATIO = 0.70
DEFAULT_PLOT = "runs/bench/swarm_generation.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("swarm-generation", __doc__, "generation", {
        "threads": "torch CPU threads per peer (the local baseline gets the total)",
        "steps": "generate calls per session at each concurrency level",
        "warmup": "untimed rounds before the sweep (every session thread generates once)"})
    parser.set_defaults(batch=8, steps=1, threads=1)
    parser.add_argument("--replicas", type=int, default=1, help="inference peers per stage")
    parser.add_argument("--rtt-ms", type=float, default=100.0,
                        help="round trip of every hop, on the client's node")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,2,4,8,16",
                        help="comma-separated numbers of concurrent sessions")
    parser.add_argument("--codec", default="bf16", choices=CODECS, help="activation codec")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: local,swarm")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="plot file, or 'none'")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency needs numbers >= 1")
    if min(args.stages, args.replicas, args.threads, args.batch, args.steps,
           args.max_new_tokens) < 1 or args.warmup < 0 or args.rtt_ms < 0:
        parser.error("--stages, --replicas, --threads, --batch, --steps and --max-new-tokens must "
                     "be >= 1, --warmup and --rtt-ms >= 0")
    if args.profile:
        parser.error("--profile is not supported by this bench")
    return args


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    from decentrl.tasks import make_task, problems, render_prompt

    task = make_task("sums")
    return [render_prompt(task, p, tokenizer) for p in problems(task, "train", count)]


def drive(pool: ThreadPoolExecutor, chain: Any, prompt_sets: list[list[list[int]]], steps: int,
          max_new_tokens: int, pad_id: int, seed: int) -> dict[str, float]:
    """One concurrency level: len(prompt_sets) sessions on as many threads of `pool`, each calling
    `generate` `steps` times on its own prompts; returns the level's wall time, tokens and
    per-generation times. The pool's threads live for the whole sweep: a thread's first parallel
    torch call sets up its own CPU thread team, which the warm-up pays once for every thread."""
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
            # No stop ids: every row decodes exactly max_new_tokens (see the docstring).
            out = generate(chain, prompt_sets[index], max_new_tokens, sampling, set(), pad_id,
                           seed * 1_000_003 + index * 1_009 + step)
            seconds.append(time.perf_counter() - began)
            tokens += sum(len(g.tokens) for g in out)
        return tokens

    futures = [pool.submit(session, i) for i in range(concurrency)]
    start.wait(timeout=600)
    began, began_cpu = time.perf_counter(), common.cpu_seconds()
    new_tokens = sum(future.result() for future in futures)
    wall, cpu = time.perf_counter() - began, common.cpu_seconds() - began_cpu
    expected = concurrency * steps * len(prompt_sets[0]) * max_new_tokens
    if new_tokens != expected:
        raise RuntimeError(f"{new_tokens} new tokens, expected {expected}")
    return {"concurrency": concurrency, "new_tokens": new_tokens, "wall_s": wall, "cpu_s": cpu,
            "tokens_per_s": new_tokens / wall,
            "generation_s_mean": sum(seconds) / len(seconds), "generation_s_max": max(seconds)}


def sweep(chain: Any, prompts: list[list[int]], args: argparse.Namespace, pad_id: int,
          label: str) -> list[dict[str, float]]:
    batch, most = args.batch, max(args.concurrency)
    sets = [prompts[i * batch:(i + 1) * batch] for i in range(most)]
    levels = []
    with ThreadPoolExecutor(max_workers=most, thread_name_prefix="session") as pool:
        for _ in range(args.warmup):  # every thread once (and, in the swarm, every replica)
            drive(pool, chain, sets, 1, args.max_new_tokens, pad_id, args.seed + 1)
        for concurrency in args.concurrency:
            level = drive(pool, chain, sets[:concurrency], args.steps, args.max_new_tokens,
                          pad_id, args.seed)
            print(f"  {label} concurrency {concurrency:3d}: {level['tokens_per_s']:8.1f} new "
                  f"tok/s ({level['wall_s']:.2f} s, {level['generation_s_mean']:.2f} s per "
                  f"generation)", flush=True)
            levels.append(level)
    return levels


def run_local(args: argparse.Namespace, loaded: Any, device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.chain import LocalChain

    threads = args.stages * args.replicas * args.threads
    torch.set_num_threads(threads)
    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    chain = LocalChain(build_stages(loaded.spec, plan, loaded.tensors, device, dtype))
    prompts = make_prompts(loaded.tokenizer, max(args.concurrency) * args.batch)
    levels = sweep(chain, prompts, args, loaded.tokenizer.pad_token_id, "local")
    return {"threads": threads, "levels": levels}


def run_swarm(args: argparse.Namespace, loaded: Any, folder: Path) -> dict[str, Any]:
    from decentrl.net.directory import Directory
    from decentrl.swarm.sessions import RemoteChain

    torch.set_num_threads(1)  # the client only relays; the peers compute
    config = parse_config({
        "name": "swarm-generation", "run_dir": str(folder / "runs"), "model": str(loaded.path),
        "num_stages": args.stages, "device": args.device, "dtype": args.dtype,
        "threads": args.threads, "seed": args.seed,
        # Peers never call each other while generating; only the client's link matters.
        "swarm": {"link": {"rtt_ms": [args.rtt_ms, args.rtt_ms]},
                  "activation_codec": args.codec, "announce_every_s": 60.0,
                  "request_timeout_s": 120.0, "inference_replicas": args.replicas,
                  # Every session comes from this one client: its own cap must allow them.
                  "max_sessions_per_peer": max(32, 2 * max(args.concurrency)),
                  "max_sessions_per_sender": max(32, 2 * max(args.concurrency))},
    })
    config_path = common.fresh_swarm_folder(config)
    # Inference replicas only; the bootstrap node is the client and carries the emulated link.
    swarm = LocalSwarm(config, config_path, args.replicas, training=False)
    try:
        started = time.perf_counter()
        swarm.start()
        assert swarm.bootstrap is not None
        print(f"  {len(swarm.children)} peers up in {time.perf_counter() - started:.0f}s: "
              + "; ".join(swarm.layout()), flush=True)
        directory = Directory(swarm.bootstrap, config.name, config.num_stages, config.swarm)
        wait_for_peers(directory, args.replicas)
        chain = RemoteChain(swarm.bootstrap, directory, config.swarm, config.trust,
                            loaded.spec)
        prompts = make_prompts(loaded.tokenizer, max(args.concurrency) * args.batch)
        levels = sweep(chain, prompts, args, loaded.tokenizer.pad_token_id, "swarm")
        return {"threads": args.threads, "peers": swarm.layout(), "failovers": chain.failovers,
                "levels": levels}
    finally:
        swarm.shutdown()


def wait_for_peers(directory: Any, replicas: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        directory.refresh()
        if all(len(records) >= replicas for records in directory.stage_summary()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every stage announced {replicas} replicas within "
                               f"{timeout_s:.0f}s")
        time.sleep(0.5)


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded, device, dtype = common.variant_setup(args)
    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as folder:
        if variant == "local":
            result = run_local(args, loaded, device, dtype)
        else:
            loaded.tensors.clear()  # the peers load their own stages
            result = run_swarm(args, loaded, Path(folder))
    prompt_lengths = [len(p) for p in make_prompts(loaded.tokenizer, args.batch)]
    return {"variant": variant, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "machine": common.machine(device),
            "prompt_lengths": prompt_lengths, **result}


def main(argv: list[str] | None = None) -> None:
    common.run_variants(Path(__file__), argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by_name = {r["variant"]: r for r in results}
    local, swarm = by_name.get("local"), by_name.get("swarm")
    figures: dict[str, float] = {}
    rows = []
    ratios: dict[int, float] = {}
    for i, concurrency in enumerate(args.concurrency):
        bound = concurrency * args.batch / (args.stages * args.rtt_ms / 1000) \
            if args.rtt_ms > 0 else float("inf")
        row: list[Any] = [concurrency, concurrency * args.batch]
        for name, result in (("local", local), ("swarm", swarm)):
            if result is None:
                row += ["-", "-"]
                continue
            level = result["levels"][i]
            row += [level["tokens_per_s"], level["generation_s_mean"]]
            figures[f"{name}_tokens_per_s_c{concurrency}"] = level["tokens_per_s"]
        ratio = None
        if local is not None and swarm is not None:
            ratio = swarm["levels"][i]["tokens_per_s"] / local["levels"][i]["tokens_per_s"]
            ratios[concurrency] = ratio
            figures[f"ratio_c{concurrency}"] = ratio
        row += ["-" if ratio is None else ratio, bound]
        rows.append(row)
    first = results[0]
    lengths = first["prompt_lengths"]
    threads = args.stages * args.replicas * args.threads
    caption = (f"{first['device']}, {first['dtype']}; {args.stages} stages x {args.replicas} "
               f"replica(s), {args.threads} thread(s) per peer (local: {threads}); client link "
               f"round trip {args.rtt_ms:g} ms per hop; activations {args.codec}; each session "
               f"{args.batch} sums prompts of {min(lengths)}-{max(lengths)} tokens, exactly "
               f"{args.max_new_tokens} new tokens per row (no stop ids), {args.steps} "
               f"generation(s) per session per level; latency bound = C x B / (stages x rtt)\n"
               f"{first['machine']}")
    common.print_table("swarm generation: new tokens/s by concurrent sessions",
                       ["sessions", "sequences", "local tok/s", "local s/gen", "swarm tok/s",
                        "swarm s/gen", "swarm / local", "latency bound tok/s"], rows, caption)
    if ratios:
        best = max(ratios, key=lambda c: ratios[c])
        reached = [c for c in args.concurrency if ratios[c] >= TARGET_RATIO]
        figures["best_ratio"] = ratios[best]
        print(f"swarm / local: best {ratios[best]:.2f} at {best} sessions; target >= "
              f"{TARGET_RATIO:.2f} " + (f"reached from {reached[0]} sessions" if reached
                                        else "not reached"))
    if swarm is not None:
        figures["swarm_failovers"] = float(swarm["failovers"])
    common.print_figures("swarm_generation", figures)
    if args.plot and args.plot != "none":
        plot(results, args, ratios, Path(args.plot))
    common.write_json(args.json, {"bench": "swarm-generation", "args": vars(args),
                                  "results": results, "figures": figures})


def plot(results: list[dict[str, Any]], args: argparse.Namespace, ratios: dict[int, float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for result in results:
        axes.plot(args.concurrency, [level["tokens_per_s"] for level in result["levels"]],
                  marker="o", label=result["variant"])
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
    axes.set_xlabel(f"concurrent sessions (each {args.batch} sequences)")
    axes.set_ylabel("new tokens/s")
    axes.grid(alpha=0.3)
    if ratios:
        twin = axes.twinx()
        twin.plot(list(ratios), list(ratios.values()), color="gray", linestyle="--", marker=".",
                  label="swarm / local")
        twin.axhline(TARGET_RATIO, color="gray", linewidth=0.8, linestyle=":")
        twin.set_ylabel("swarm / local")
        twin.set_ylim(0, max(1.05, *ratios.values()))
        twin.legend(loc="lower right")
    axes.legend(loc="upper left")
    axes.set_title(f"generation through {args.stages} stage peers, {args.rtt_ms:g} ms per hop")
    common.save_figure(figure, path)


if __name__ == "__main__":
    main()
