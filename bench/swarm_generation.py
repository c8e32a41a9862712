"""Swarm generation tokens/s as sessions in flight grow.

Generation throughput (new tokens/s) through a swarm of stage peers with an emulated round trip
on every hop, against two single-process baselines on the same cores, as the number of concurrent
sessions grows.

What runs:
- `swarm`: `--stages` stages, `--replicas` inference peers per stage (default 1), each peer a
  separate `decentrl join` process on loopback holding only its stage's layers, `--threads` torch
  threads per peer (default 1). The bench process is the client. Every node carries the emulated
  link (`LinkProfile(rtt_ms=(R, R))`, `--rtt-ms` R = 100 by default), which sits on the caller's
  side of every hop: a request costs R/2 one way, its reply R/2 back. `--planes` sets the swarm's
  `swarm.data_plane`: with activations relayed (`coordinator`, "(relayed)") the client calls
  every stage itself, so a decoding step costs `stages` x R; pushed peer to peer (the default)
  the client pushes the tokens to stage 0 while asking the last stage for the step's tokens, and
  each stage pushes to the next: (stages + 1) x R / 2. `both` runs the two side by side. It drives C concurrent sessions (`--concurrency`, default
  1,2,4,8,16), each a Python thread calling `generate` on one shared `RemoteChain` with its own
  batch of `--batch` B sums prompts. Activations travel with `--codec` (default bf16, the swarm's
  default). `--batching on|off|both` (default both) sets the peers' `swarm.batching`: `off` is
  one request at a time per peer ("before" issue #20), `on` the peer's step scheduler ("after");
  `both` runs the swarm twice, so before and after come from one run.
- `batched` (the headline baseline, issue #20's): Hugging Face `generate` on the whole model in
  one process, no network, all C x B rows of a level as ONE left-padded batch, sampled at
  temperature 1 with a fixed seed, eos ignored. The strongest single-process way to produce the
  same rows; the figure is swarm / batched per level (issue #20's target: >= 0.9 at 16 sessions).
- `local` (the per-session baseline): the same C threads, prompts and seeds calling decentrl's
  `generate` on a `LocalChain` of the same stages in one process, each session its own batch of B
  rows: no network, no latency, no batching across sessions (swarm / local >= 0.70 was the target
  of the concurrency work before issue #20).

Fair amount of work: no stop ids, so every row decodes exactly `--max-new-tokens` T tokens in
every variant; one concurrency level decodes C x `--steps` x B x T new tokens; tokens/s is that
over the wall time of the level: for the session variants from releasing the C threads to the
last one finishing, after `--warmup` untimed rounds in which every session thread generates once
(the threads are reused across levels); for `batched`, its `--steps` generate calls after
`--warmup` untimed ones of the same rows at every level (a batch shape's first call is slower).
A decoding step of one swarm session cannot take less than its hops (sequential), so one session
is bounded by B / (stages x R) tokens/s relayed and B / ((stages + 1) x R / 2) peer to peer,
whatever the compute ("latency bound" columns); concurrency is what hides the latency: while one session waits on the
network, the peers compute the others.

On a CPU-only machine the peers and the baselines share the same cores, so the ratios do not
measure added hardware: they measure whether the swarm hides its latency and RPC overhead with
concurrency. To keep the comparison level, both baselines get the same total thread count as all
peers together (stages x replicas x threads: by default 2, this machine's cores), and the swarm's
client process (which only relays) runs 1 thread. Each variant runs in its own process
(`--in-process`: all in this one).

Run: decentrl bench swarm-generation [--model smollm2-135m-instruct|tiny|PATH] [--stages 2]
     [--replicas 1] [--threads 1] [--rtt-ms 100] [--batch 8] [--max-new-tokens 32]
     [--concurrency 1,2,4,8,16] [--steps 1] [--codec bf16] [--variants local,batched,swarm]
     [--batching both|on|off] [--planes peer_to_peer|coordinator|both] [--plot PATH|none]
     [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import common

VARIANTS = ("local", "batched", "swarm")
BATCHING = {"off": ("off",), "on": ("on",), "both": ("off", "on")}
CODECS = ("fp32", "bf16", "int8")
TARGET_VS_LOCAL = 0.70
TARGET_VS_BATCHED = 0.90  # issue #20, at TARGET_SESSIONS
TARGET_SESSIONS = 16
DEFAULT_PLOT = "runs/bench/swarm_generation.png"
LABELS = {"local": "per-session local", "batched": "one batch (HF)", "swarm-off": "swarm off",
          "swarm-on": "swarm on", "swarm-off-relayed": "swarm off (relayed)",
          "swarm-on-relayed": "swarm on (relayed)"}
# --planes: the swarm's data planes (swarm.data_plane); a relayed variant's name ends so.
PLANES = {"peer_to_peer": ("peer_to_peer",), "coordinator": ("coordinator",),
          "both": ("coordinator", "peer_to_peer")}
TARGET_PUSH_VS_RELAYED = 1.5  # issue #36, at 4 stages and 100 ms per hop
# Swarm variants set side by side: (numerator, denominator, figure name).
COMPARED = (("swarm-on", "swarm-off", "swarm_on_vs_off"),
            ("swarm-on", "swarm-on-relayed", "swarm_on_vs_relayed"),
            ("swarm-off", "swarm-off-relayed", "swarm_off_vs_relayed"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("swarm-generation", __doc__, "generation", {
        "threads": "torch CPU threads per peer (each baseline gets the total)",
        "steps": "generate calls per session (batched: per level) at each concurrency level",
        "warmup": "untimed rounds before the sweep (every session thread generates once; "
                  "batched: untimed calls of the same rows at every level)"})
    parser.set_defaults(batch=8, steps=1, threads=1)
    parser.add_argument("--replicas", type=int, default=1, help="inference peers per stage")
    parser.add_argument("--rtt-ms", type=float, default=100.0,
                        help="round trip of every hop, on the client's node")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,2,4,8,16",
                        help="comma-separated numbers of concurrent sessions")
    parser.add_argument("--codec", default="bf16", choices=CODECS, help="activation codec")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: local,batched,swarm")
    parser.add_argument("--batching", default="both", choices=tuple(BATCHING),
                        help="the swarm peers' swarm.batching (both: run the swarm once with "
                             "each)")
    parser.add_argument("--planes", default="peer_to_peer", choices=tuple(PLANES),
                        help="the swarm's swarm.data_plane (both: run the swarm with each, "
                             "activations relayed through the client and pushed peer to peer)")
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="plot file, or 'none'")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    # The swarm runs once per batching setting, each a variant of its own (own worker process).
    args.variants = [name for v in variants for name in
                     ([f"swarm-{b}{'-relayed' if plane == 'coordinator' else ''}"
                       for b in BATCHING[args.batching] for plane in PLANES[args.planes]]
                      if v == "swarm" else [v])]
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency needs numbers >= 1")
    if min(args.stages, args.replicas, args.threads, args.batch, args.steps,
           args.max_new_tokens) < 1 or args.warmup < 0 or args.rtt_ms < 0:
        parser.error("--stages, --replicas, --threads, --batch, --steps and --max-new-tokens must "
                     "be >= 1, --warmup and --rtt-ms >= 0")
    if args.profile:
        parser.error("--profile is not supported by this bench")
    return args


def baseline_threads(args: argparse.Namespace) -> int:
    """What each single-process baseline gets: as many torch threads as all peers together."""
    return args.stages * args.replicas * args.threads


def run_local(args: argparse.Namespace, loaded: Any, device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.chain import LocalChain

    torch.set_num_threads(baseline_threads(args))
    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    chain = LocalChain(build_stages(loaded.spec, plan, loaded.tensors, device, dtype))
    prompts = common.sums_prompts(loaded.tokenizer, max(args.concurrency) * args.batch)
    levels = common.sweep_sessions(chain, prompts, args, loaded.tokenizer.pad_token_id, "local")
    return {"threads": baseline_threads(args), "levels": levels}


def run_batched(args: argparse.Namespace, loaded: Any, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """Every level's C x B rows as one HF `generate` batch, `--steps` times after `--warmup`
    untimed calls of the same rows at that level. Warmed at every level, not only the first: the
    first call of a new batch shape pays the allocator for its larger tensors (the 128-row call
    ran cold before), which the swarm's sessions, warmed at the largest level, do not."""
    torch.set_num_threads(baseline_threads(args))
    model = common.hf_generation_model(loaded.path, device, dtype)
    loaded.tensors.clear()  # HF loaded its own copy
    pad_id = loaded.tokenizer.pad_token_id
    prompts = common.sums_prompts(loaded.tokenizer, max(args.concurrency) * args.batch)
    levels = []
    for concurrency in args.concurrency:
        rows = prompts[:concurrency * args.batch]
        # CPU time too: on a shared machine wall time is the load's as much as the call's.
        warmup_seconds, warmup_cpu = [], []
        for _ in range(args.warmup):
            started, started_cpu = time.perf_counter(), common.cpu_seconds()
            common.hf_generate(model, rows, pad_id, args.max_new_tokens, True, args.seed + 1)
            common.sync(device)
            warmup_seconds.append(time.perf_counter() - started)
            warmup_cpu.append(common.cpu_seconds() - started_cpu)
        seconds = []
        new_tokens = 0
        began, began_cpu = time.perf_counter(), common.cpu_seconds()
        for step in range(args.steps):
            started = time.perf_counter()
            out = common.hf_generate(model, rows, pad_id, args.max_new_tokens, True,
                                     args.seed + step)
            common.sync(device)
            seconds.append(time.perf_counter() - started)
            new_tokens += sum(len(row) for row in out)
        wall, cpu = time.perf_counter() - began, common.cpu_seconds() - began_cpu
        level = {"concurrency": concurrency, "new_tokens": new_tokens, "wall_s": wall,
                 "cpu_s": cpu, "tokens_per_s": new_tokens / wall,
                 "generation_s_mean": sum(seconds) / len(seconds),
                 "generation_s_max": max(seconds), "warmup_s": warmup_seconds,
                 "warmup_cpu_s": warmup_cpu}
        warm = (f", after {len(warmup_seconds)} warm-up call(s) of "
                f"{', '.join(f'{w:.2f}' for w in warmup_seconds)} s, CPU "
                f"{', '.join(f'{c:.2f}' for c in warmup_cpu)} s" if warmup_seconds else "")
        print(f"  batched concurrency {concurrency:3d}: {level['tokens_per_s']:8.1f} new tok/s "
              f"({len(rows)} rows in one batch, {wall:.2f} s, CPU {cpu / args.steps:.2f} s per "
              f"call{warm})", flush=True)
        levels.append(level)
    return {"threads": baseline_threads(args), "levels": levels}


def run_swarm(args: argparse.Namespace, loaded: Any, folder: Path,
              batching: bool, plane: str) -> dict[str, Any]:
    torch.set_num_threads(1)  # the client only relays or collects; the peers compute
    config = common.inference_swarm_config("swarm-generation", folder, loaded.path, args, {
        "activation_codec": args.codec, "inference_replicas": args.replicas,
        "batching": batching, "data_plane": plane},
        # Every node's link: the client's (relayed, it calls every stage) and each peer's (peer
        # to peer, each stage calls the next).
        host={"link": {"rtt_ms": [args.rtt_ms, args.rtt_ms]}})
    with common.inference_swarm(config, loaded.spec) as (swarm, chain):
        prompts = common.sums_prompts(loaded.tokenizer, max(args.concurrency) * args.batch)
        label = f"swarm ({'batching' if batching else 'one request at a time'})"
        levels = common.sweep_sessions(chain, prompts, args, loaded.tokenizer.pad_token_id,
                                       label, common.peer_pids(swarm))
        return {"threads": args.threads, "batching": batching, "data_plane": plane,
                "peers": swarm.layout(), "failovers": chain.failovers, "levels": levels}


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded, device, dtype = common.variant_setup(args)
    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as folder:
        if variant == "local":
            result = run_local(args, loaded, device, dtype)
        elif variant == "batched":
            result = run_batched(args, loaded, device, dtype)
        else:
            loaded.tensors.clear()  # the peers load their own stages
            result = run_swarm(args, loaded, Path(folder),
                               batching=variant.startswith("swarm-on"),
                               plane="coordinator" if variant.endswith("-relayed")
                               else "peer_to_peer")
    prompt_lengths = [len(p) for p in common.sums_prompts(loaded.tokenizer, args.batch)]
    return {"variant": variant, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "machine": common.machine(device),
            "prompt_lengths": prompt_lengths, **result}


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by_name = {r["variant"]: r for r in results}
    names = [name for name in LABELS if name in by_name]
    swarms = [name for name in names if name.startswith("swarm-")]
    figures: dict[str, float] = {}
    rows, ratio_rows = [], []
    # (numerator, denominator) variants -> {sessions: ratio of their tokens/s}
    ratios: dict[tuple[str, str], dict[int, float]] = {}
    for i, concurrency in enumerate(args.concurrency):
        # A relayed step makes `stages` round trips; a pushed one stages + 1 one-way hops.
        rtt_s = args.rtt_ms / 1000
        bound = concurrency * args.batch / (args.stages * rtt_s) if rtt_s else float("inf")
        push_bound = concurrency * args.batch / ((args.stages + 1) * rtt_s / 2) if rtt_s \
            else float("inf")
        speed = {name: by_name[name]["levels"][i]["tokens_per_s"] for name in names}
        for name, value in speed.items():
            figures[f"{name.replace('-', '_')}_tokens_per_s_c{concurrency}"] = value
        rows.append([concurrency, concurrency * args.batch,
                     *(speed.get(name, "-") for name in LABELS), bound, push_bound])
        for swarm in swarms:
            for baseline in ("batched", "local"):
                key = (swarm, baseline)
                if baseline in speed:
                    ratio = speed[swarm] / speed[baseline]
                    ratios.setdefault(key, {})[concurrency] = ratio
                    figures[f"{swarm.replace('-', '_')}_vs_{baseline}_c{concurrency}"] = ratio
        for faster, slower, figure in COMPARED:
            if faster in speed and slower in speed:
                ratios.setdefault((faster, slower), {})[concurrency] = \
                    speed[faster] / speed[slower]
                figures[f"{figure}_c{concurrency}"] = speed[faster] / speed[slower]
        ratio_rows.append([concurrency, *(by_level[concurrency] for by_level in ratios.values())])
    first = results[0]
    lengths = first["prompt_lengths"]
    caption = (f"{first['device']}, {first['dtype']}; {args.stages} stages x {args.replicas} "
               f"replica(s), {args.threads} thread(s) per peer (each baseline: "
               f"{baseline_threads(args)}); client link round trip {args.rtt_ms:g} ms per hop; "
               f"activations {args.codec}; each session {args.batch} sums prompts of "
               f"{min(lengths)}-{max(lengths)} tokens, exactly {args.max_new_tokens} new tokens "
               f"per row (no stop ids), {args.steps} generation(s) per session per level; one "
               f"batch (HF) = HF generate of all sessions' rows as one batch in one process; "
               f"per-session local = the same sessions on a LocalChain in one process; swarm "
               f"off/on = the peers' swarm.batching, (relayed) = swarm.data_plane "
               f"coordinator, else peer_to_peer; latency bounds = C x B / (stages x rtt) "
               f"relayed, C x B / ((stages + 1) x rtt / 2) peer to peer\n"
               f"{first['machine']}")
    common.print_table("swarm generation: new tokens/s by concurrent sessions",
                       ["sessions", "sequences", *(f"{label} tok/s" for label in LABELS.values()),
                        "latency bound tok/s (relayed)", "latency bound tok/s (peer to peer)"],
                       rows, caption)
    if ratios:
        common.print_table("swarm generation: ratios of new tokens/s",
                           ["sessions", *(ratio_label(key) for key in ratios)], ratio_rows,
                           f"targets: swarm / one batch >= {TARGET_VS_BATCHED:.2f} at "
                           f"{TARGET_SESSIONS} sessions (issue #20); swarm / per-session local "
                           f">= {TARGET_VS_LOCAL:.2f} at enough concurrency")
    for key, by_level in ratios.items():
        if key[1] == "batched" and TARGET_SESSIONS in by_level:
            reached = by_level[TARGET_SESSIONS] >= TARGET_VS_BATCHED
            print(f"{ratio_label(key)} at {TARGET_SESSIONS} sessions: "
                  f"{by_level[TARGET_SESSIONS]:.2f}; target >= {TARGET_VS_BATCHED:.2f} "
                  + ("reached" if reached else "not reached"))
        if key[1].endswith("-relayed"):
            worst = min(by_level, key=lambda c: by_level[c])
            print(f"{ratio_label(key)}: {by_level[worst]:.2f} at worst ({worst} sessions); "
                  f"target >= {TARGET_PUSH_VS_RELAYED:.1f} (issue #36, 4 stages, 100 ms per "
                  f"hop) " + ("reached" if by_level[worst] >= TARGET_PUSH_VS_RELAYED
                              else "not reached"))
        if key[1] == "local":
            best = max(by_level, key=lambda c: by_level[c])
            print(f"{ratio_label(key)}: best {by_level[best]:.2f} at {best} sessions; target >= "
                  f"{TARGET_VS_LOCAL:.2f} " + ("reached" if by_level[best] >= TARGET_VS_LOCAL
                                               else "not reached"))
    for swarm in swarms:
        figures[f"{swarm.replace('-', '_')}_failovers"] = float(by_name[swarm]["failovers"])
    common.print_figures("swarm_generation", figures)
    if args.plot and args.plot != "none":
        plot(results, args, ratios, Path(args.plot))
    common.write_json(args.json, {"bench": "swarm-generation", "args": vars(args),
                                  "results": results, "figures": figures})


def ratio_label(key: tuple[str, str]) -> str:
    return f"{LABELS[key[0]]} / {LABELS[key[1]]}"


def plot(results: list[dict[str, Any]], args: argparse.Namespace,
         ratios: dict[tuple[str, str], dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for result in results:
        axes.plot(args.concurrency, [level["tokens_per_s"] for level in result["levels"]],
                  marker="o", label=LABELS[result["variant"]])
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
    axes.set_xlabel(f"concurrent sessions (each {args.batch} sequences)")
    axes.set_ylabel("new tokens/s")
    axes.grid(alpha=0.3)
    headline = {key: by_level for key, by_level in ratios.items() if key[1] == "batched"}
    if headline:
        twin = axes.twinx()
        for key, by_level in headline.items():
            twin.plot(list(by_level), list(by_level.values()), linestyle="--", marker=".",
                      label=ratio_label(key))
        twin.axhline(TARGET_VS_BATCHED, color="gray", linewidth=0.8, linestyle=":")
        twin.set_ylabel("swarm / one batch")
        twin.set_ylim(0, max(1.05, *(r for by in headline.values() for r in by.values())))
        twin.legend(loc="lower right")
    axes.legend(loc="upper left")
    axes.set_title(f"generation through {args.stages} stage peers, {args.rtt_ms:g} ms per hop")
    common.save_figure(figure, path)


if __name__ == "__main__":
    main()
