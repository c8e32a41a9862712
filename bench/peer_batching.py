"""Stage peer tokens/s by concurrent sessions, batching off and on.

How much one stage peer serves as the sessions it holds grow, with its step scheduler off
(`swarm.batching=false`: one request at a time, "before" issue #20) and on ("after"), side by
side in one run. It measures the peer, not the network: no emulated latency anywhere.

What runs: for each batching setting (`--batching off|on|both`, default both), one `decentrl join`
process on loopback holding every layer of the model as a single stage (`--stages 1`, so it also
samples the tokens; `--stages N` splits the model over N peers instead, all on the same cores),
`--threads` torch threads per peer (default 2, this machine's cores), joining with a run config
whose `swarm.batching` is the setting. The bench process is the client (1 torch thread: it only
relays): it drives C concurrent sessions (`--concurrency`, default 1,2,4,8,16,32), each a Python
thread calling `generate` on one shared `RemoteChain`, so every decoding step is a real
`inference_step` RPC; each session is a batch of `--batch` B rows (default 8), sampled at
temperature 1 with a fixed seed per session: by default one sums problem's prompt on every row,
as the swarm's generation sessions are rollout groups (`--sessions groups`; the peer prefills a
repeated prompt once), or B different problems (`--sessions distinct`: the prefill is B times
larger, and it is the same work with batching off and on).

Fair amount of work: no stop ids, so every row decodes exactly `--max-new-tokens` T tokens (default
32); one concurrency level decodes C x `--steps` x B x T new tokens; tokens/s is that over the wall
time from releasing the C session threads to the last one finishing, after `--warmup` untimed
rounds in which every session thread generates once. Each setting runs in its own bench process
with its own peer (`--in-process`: both from this one, still one peer process per setting).
Figure: after / before new tokens/s per level; issue #20's target is >= 3 at 16 sessions. The
peer's CPU time per level (from /proc, Linux) gives new tokens per peer CPU second too, the
steadier figure on a shared machine (it counts threads spinning while they wait, though). The
launcher runs inference peers at a lower priority (`nice`), so on a busy machine other processes
slow the peer down more than they would the bench itself.

Run: decentrl bench peer-batching [--model smollm2-135m-instruct|tiny|PATH] [--threads 2]
     [--batch 8] [--max-new-tokens 32] [--concurrency 1,2,4,8,16,32] [--batching both|off|on]
     [--sessions groups|distinct]
     [--steps 1] [--warmup 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import common

BATCHING = {"off": ("off",), "on": ("on",), "both": ("off", "on")}
TARGET_RATIO = 3.0  # issue #20: after / before at TARGET_SESSIONS
TARGET_SESSIONS = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("peer-batching", __doc__, "generation", {
        "threads": "torch CPU threads per peer",
        "stages": "peers the model is split over (1: one peer holds every layer and samples)",
        "steps": "generate calls per session at each concurrency level",
        "batch": "rows per session",
        "warmup": "untimed rounds before the sweep (every session thread generates once)",
        "in_process": "drive both batching settings from this process (each still gets its own "
                      "peer process)"})
    parser.set_defaults(batch=8, steps=1, threads=2, stages=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32",
                        help="comma-separated numbers of concurrent sessions")
    parser.add_argument("--sessions", default="groups", choices=("groups", "distinct"),
                        help="groups: each session is one problem's prompt on every row, the "
                             "shape of the swarm's generation sessions (a rollout group); "
                             "distinct: every row its own problem")
    parser.add_argument("--batching", default="both", choices=tuple(BATCHING),
                        help="the peer's swarm.batching (both: one peer with each)")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency must be comma-separated integers")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency needs numbers >= 1")
    if min(args.stages, args.threads, args.batch, args.steps, args.max_new_tokens) < 1 \
            or args.warmup < 0:
        parser.error("--stages, --threads, --batch, --steps and --max-new-tokens must be >= 1, "
                     "--warmup >= 0")
    if args.profile:
        parser.error("--profile is not supported by this bench (the work runs in the peer)")
    args.variants = list(BATCHING[args.batching])
    return args


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded, device, dtype = common.variant_setup(args)
    loaded.tensors.clear()  # the peer loads its own weights
    machine = common.machine(device)  # while torch threads are still --threads, the peer's
    torch.set_num_threads(1)  # the client only relays; the peer computes
    batching = variant == "on"
    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as folder:
        config = common.inference_swarm_config("peer-batching", Path(folder), loaded.path, args,
                                               {"inference_replicas": 1, "batching": batching})
        with common.inference_swarm(config, loaded.spec) as (swarm, chain):
            sessions = max(args.concurrency)
            if args.sessions == "groups":  # one problem's prompt on every row of a session
                prompts = [prompt for prompt in common.sums_prompts(loaded.tokenizer, sessions)
                           for _ in range(args.batch)]
            else:
                prompts = common.sums_prompts(loaded.tokenizer, sessions * args.batch)
            label = f"batching {variant}"
            levels = common.sweep_sessions(chain, prompts, args, loaded.tokenizer.pad_token_id,
                                           label, common.peer_pids(swarm))
            peers, failovers = swarm.layout(), chain.failovers
    # The peer runs on this machine and picks its dtype as variant_setup did (compute_dtype).
    return {"variant": variant, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "machine": machine,
            "model": str(loaded.path), "layers": loaded.spec.num_layers, "peers": peers,
            "failovers": failovers, "prompt_lengths": [len(p) for p in prompts[:args.batch]],
            "levels": levels}


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by_name = {r["variant"]: r for r in results}
    before, after = by_name.get("off"), by_name.get("on")
    figures: dict[str, float] = {}
    rows = []
    ratios: dict[int, float] = {}
    for i, concurrency in enumerate(args.concurrency):
        row: list[Any] = [concurrency, concurrency * args.batch]
        per_cpu: dict[str, float] = {}
        for name, result in (("off", before), ("on", after)):
            if result is None:
                row += ["-", "-"]
                continue
            level = result["levels"][i]
            figures[f"batching_{name}_tokens_per_s_c{concurrency}"] = level["tokens_per_s"]
            if level.get("peer_cpu_s"):
                per_cpu[name] = level["new_tokens"] / level["peer_cpu_s"]
                figures[f"batching_{name}_tokens_per_peer_cpu_s_c{concurrency}"] = per_cpu[name]
            row += [level["tokens_per_s"], per_cpu.get(name, "-")]
        cpu_ratio: float | str = "-"
        if before is not None and after is not None:
            ratios[concurrency] = (after["levels"][i]["tokens_per_s"]
                                   / before["levels"][i]["tokens_per_s"])
            figures[f"ratio_c{concurrency}"] = ratios[concurrency]
            if len(per_cpu) == 2:
                cpu_ratio = per_cpu["on"] / per_cpu["off"]
                figures[f"cpu_ratio_c{concurrency}"] = cpu_ratio
        rows.append([*row, ratios.get(concurrency, "-"), cpu_ratio])
    first = results[0]
    lengths = first["prompt_lengths"]
    caption = (f"model {Path(first['model']).name} ({first['layers']} layers), {first['device']}, "
               f"{first['dtype']} (the peer's compute_dtype); {args.stages} stage peer(s), "
               f"{args.threads} torch thread(s) each, client 1 thread; no emulated latency; each "
               f"session {args.batch} rows of "
               f"{'one sums prompt (a group)' if args.sessions == 'groups' else 'sums prompts'} "
               f"of {min(lengths)}-{max(lengths)} tokens, "
               f"exactly {args.max_new_tokens} new tokens per row (no stop ids), {args.steps} "
               f"generation(s) per session per level; off = swarm.batching false (one request "
               f"at a time), on = true; tok/peer CPU s = new tokens per second of the peer "
               f"process's CPU time (steadier than wall time on a shared machine)\n"
               f"{first['machine']}")
    common.print_table("peer batching: new tokens/s by concurrent sessions",
                       ["sessions", "rows", "off tok/s", "off tok/peer CPU s", "on tok/s",
                        "on tok/peer CPU s", "on / off", "on / off per CPU s"], rows, caption)
    if TARGET_SESSIONS in ratios:
        reached = ratios[TARGET_SESSIONS] >= TARGET_RATIO
        print(f"on / off at {TARGET_SESSIONS} sessions: {ratios[TARGET_SESSIONS]:.2f}; target >= "
              f"{TARGET_RATIO:g} " + ("reached" if reached else "not reached"))
    for result in results:
        figures[f"batching_{result['variant']}_failovers"] = float(result["failovers"])
    common.print_figures("peer_batching", figures)
    common.write_json(args.json, {"bench": "peer-batching", "args": vars(args),
                                  "results": results, "figures": figures})


if __name__ == "__main__":
    main()
