"""Prefill of agentic prompts with and without a stage peer's prefix cache.

Prefix cache: the first steps of `--problems` sessions of an agentic environment (default: the
demo's, `decentrl demo --task agentic-calculator`), one after another as a stage peer serves them,
each session `--groups-per-session` problems of `--group-size` rows (a group's rows share their
prompt, and every prompt starts with the environment's system prompt, tool schema and worked
example), over `--stages` stage modules in one process.

Variants (`--variants`):
  plain    every session's prompts computed in full (each distinct row once, model/stages.py)
  cached   the same through each stage's prefix cache (model/prefix_cache.py, `--cache-tokens`
           positions), empty at the start of every run: the first session fills it

Figures: seconds per run (all the sessions' first steps), the tokens (distinct rows x positions,
summed over stages) computed and taken from the cache, and whether the cached run's last-stage
outputs at each row's last position, and its greedy next tokens, equal the plain run's.

Run: python -m bench.prefix_cache [--device auto] [--problems 8] [--group-size 8]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench import common

VARIANTS = ("plain", "cached")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from decentrl.config import SwarmConfig

    parser = common.bench_parser("prefix_cache", __doc__, "run")
    common.add_environment_arguments(parser)
    parser.add_argument("--problems", type=int, default=8, help="problems (groups) in a run")
    parser.add_argument("--group-size", type=int, default=8, help="rows per problem")
    parser.add_argument("--groups-per-session", type=int, default=1,
                        help="problems per session (more than one: prompts left-padded to the "
                             "longest)")
    parser.add_argument("--cache-tokens", type=int,
                        default=SwarmConfig.model_fields["prefix_cache_tokens"].default,
                        help="positions each stage's prefix cache holds "
                             "(swarm.prefix_cache_tokens)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: plain,cached")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    common.parse_environment_options(parser, args)
    if (args.steps < 1 or args.warmup < 0 or args.problems < 1 or args.group_size < 1
            or args.groups_per_session < 1 or args.cache_tokens < 1):
        parser.error("--steps, --problems, --group-size, --groups-per-session and --cache-tokens "
                     "must be >= 1, --warmup >= 0")
    return args


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from decentrl.envs import make_environment
    from decentrl.model.blocks import positions_from_valid
    from decentrl.model.prefix_cache import PrefixCache
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.episodes import EpisodeTokens
    from decentrl.rollout.generate import left_pad

    loaded, device, dtype = common.variant_setup(args)
    tokenizer = loaded.tokenizer
    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    stages = build_stages(loaded.spec, plan, loaded.tensors, device, dtype)
    loaded.tensors.clear()
    environment = make_environment(args.env, **args.options)
    prompts = [EpisodeTokens(environment.episode("train", problem), tokenizer).prompt()
               for problem in range(args.problems)]
    sessions = [[prompt for prompt in prompts[first:first + args.groups_per_session]
                 for _ in range(args.group_size)]
                for first in range(0, args.problems, args.groups_per_session)]
    capacity = args.cache_tokens if variant == "cached" else 0  # 0: the plain prefill
    last_run: list[PrefixCache] = []

    def prefill(caches: list[PrefixCache]) -> list[torch.Tensor]:
        """Every session's first step; the last stage's outputs at each row's last position."""
        last = []
        with torch.inference_mode():
            for rows in sessions:
                ids, valid = left_pad(rows, tokenizer.pad_token_id, device)
                positions = positions_from_valid(valid)
                x = ids
                for stage, prefix_cache in zip(stages, caches):
                    x = prefix_cache.prefill(x, positions, valid,
                                             stage.new_cache(len(rows), ids.shape[1]))
                last.append(stages[-1].head(x[:, -1]))
        return last

    def run() -> None:
        last_run[:] = [PrefixCache(stage, capacity) for stage in stages]
        prefill(last_run)

    common.reset_peak_memory(device)
    stats = common.summary(common.time_calls(run, device, args.warmup, args.steps))
    if args.profile:
        common.profile(run, device, variant)
    result: dict[str, Any] = {
        "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "machine": common.machine(device), "prompt_lengths": [len(p) for p in prompts], **stats,
        "computed_tokens": sum(c.computed_tokens for c in last_run),
        "reused_tokens": sum(c.reused_tokens for c in last_run)}
    if variant == "cached":  # a fresh cache's run against the plain prefill, untimed
        cached = prefill([PrefixCache(stage, capacity) for stage in stages])
        plain = prefill([PrefixCache(stage, 0) for stage in stages])
        result["identical_outputs"] = all(torch.equal(a, b) for a, b in zip(cached, plain))
        result["max_output_diff"] = max(float((a.float() - b.float()).abs().max())
                                        for a, b in zip(cached, plain))
        result["same_greedy_tokens"] = all(torch.equal(a.argmax(-1), b.argmax(-1))
                                           for a, b in zip(cached, plain))
    result["peak_mib"], result["peak_kind"] = common.peak_memory_mib(device)
    return result


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = results[0]
    lengths = first["prompt_lengths"]
    by_name = {r["variant"]: r for r in results}
    figures: dict[str, float] = {"prompt_tokens_per_row": sum(lengths) / len(lengths)}
    rows = []
    for r in results:
        rows.append([r["variant"], r["mean_s"], r["min_s"], r["cpu_mean_s"], r["computed_tokens"],
                     r["reused_tokens"], r["peak_mib"]])
        figures[f"{r['variant']}_s"] = r["mean_s"]
        figures[f"{r['variant']}_computed_tokens"] = r["computed_tokens"]
    if "cached" in by_name:
        cached = by_name["cached"]
        figures["cached_reused_tokens"] = cached["reused_tokens"]
        figures["reused_share"] = cached["reused_tokens"] / (cached["reused_tokens"]
                                                             + cached["computed_tokens"])
        if "plain" in by_name:
            figures["speedup"] = by_name["plain"]["mean_s"] / cached["mean_s"]
    memory = first["peak_kind"] + (" of the whole bench process" if args.in_process else "")
    caption = (f"{first['device']}, {first['dtype']}, {args.stages} stages; {args.env} "
               f"{json.dumps(args.options)}; {args.problems} problems x {args.group_size} rows, "
               f"{args.groups_per_session} problem(s) per session, prompts of "
               f"{min(lengths)}-{max(lengths)} tokens; prefix cache {args.cache_tokens} positions "
               f"per stage, empty at each run's start; tokens: distinct rows x positions summed "
               f"over stages; warm-up {args.warmup}, {args.steps} timed runs; memory: {memory}\n"
               f"{first['machine']}")
    common.print_table("prefix cache: agentic prompts' first steps",
                       ["variant", "s/run", "min s/run", "CPU s/run", "tokens computed",
                        "tokens reused", "peak MiB"], rows, caption)
    if "cached" in by_name:
        cached = by_name["cached"]
        print(f"cached against plain: last-stage outputs "
              f"{'bit for bit equal' if cached['identical_outputs'] else 'differ'} (largest "
              f"difference {cached['max_output_diff']:.3g}), greedy next tokens "
              f"{'equal' if cached['same_greedy_tokens'] else 'differ'}")
    common.print_figures("prefix_cache", figures)
    common.write_json(args.json, {"bench": "prefix_cache", "args": vars(args),
                                  "results": results, "figures": figures})


if __name__ == "__main__":
    main()
