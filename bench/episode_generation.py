"""Where the time of agentic episode generation goes.

Episode generation: where the time of agentic rollouts goes. `--batch` episodes of an
environment (default: the agentic demo's, `decentrl demo --task agentic-calculator`) in one
session over a LocalChain of `--stages` stages, `--group-size` episodes per problem as a swarm
group has, so each group's rows share one prompt.

Variants (`--variants`):
  prefill   the prompts alone: one step that prefills every row's prompt and samples its first
            token, which every row pays before it generates anything else
  episodes  the whole episodes, to the end or to `--max-new-tokens` (the environment's replies are
            fed as forced tokens and count against it)

Figures: seconds per run of each, the prefill's share of an episode run, prompt tokens per row,
the share of prompt tokens that repeat a prompt of the same group (a session's first step runs
each distinct row once and copies it to its repeats, model/stages.py, so these cost no compute),
and sampled tokens per second of the episode runs.

Run: python -m bench.episode_generation [--device auto] [--batch 16] [--group-size 8]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench import common

VARIANTS = ("prefill", "episodes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:

    parser = common.bench_parser("episode_generation", __doc__, "run",
                                 {"batch": "episodes per run (the rows of one session)"})
    common.add_environment_arguments(parser)
    parser.add_argument("--group-size", type=int, default=8,
                        help="episodes per problem (a group's rows share their prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: prefill,episodes")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    common.parse_environment_options(parser, args)
    if (args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.group_size < 1
            or args.max_new_tokens < 1):
        parser.error("--steps, --batch, --group-size and --max-new-tokens must be >= 1, "
                     "--warmup >= 0")
    return args


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from decentrl.envs import make_environment
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.episodes import EpisodeTokens, generate_episodes
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig

    loaded, device, dtype = common.variant_setup(args)
    tokenizer = loaded.tokenizer
    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    chain = LocalChain(build_stages(loaded.spec, plan, loaded.tensors, device, dtype))
    loaded.tensors.clear()
    environment = make_environment(args.env, **args.options)
    sampling = SamplingConfig(temperature=args.temperature)

    def fresh_episodes() -> list[Any]:  # an episode keeps its state: every run needs new ones
        return [environment.episode("train", row // args.group_size) for row in range(args.batch)]

    prompts = [EpisodeTokens(e, tokenizer).prompt() for e in fresh_episodes()]
    sampled: list[int] = []  # per run, the tokens the model sampled

    def run() -> None:
        if variant == "prefill":
            generate(chain, prompts, 1, sampling, set(), tokenizer.pad_token_id, args.seed)
            sampled.append(len(prompts))
            return
        rollouts = generate_episodes(chain, fresh_episodes(), tokenizer, args.max_new_tokens,
                                     sampling, args.seed)
        sampled.append(sum(sum(r.generation.generated) for r in rollouts))

    common.reset_peak_memory(device)
    stats = common.summary(common.time_calls(run, device, args.warmup, args.steps))
    if args.profile:
        common.profile(run, device, variant)
    distinct = {tuple(p) for p in prompts}
    result: dict[str, Any] = {
        "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "machine": common.machine(device), "prompt_lengths": [len(p) for p in prompts],
        "distinct_prompt_tokens": sum(len(p) for p in distinct), **stats,
        "sampled_tokens": sum(sampled[-args.steps:]) / args.steps}
    result["peak_mib"], result["peak_kind"] = common.peak_memory_mib(device)
    return result


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = results[0]
    lengths = first["prompt_lengths"]
    prompt_tokens = sum(lengths)
    figures: dict[str, float] = {
        "prompt_tokens_per_row": prompt_tokens / len(lengths),
        "repeated_prompt_share": 1 - first["distinct_prompt_tokens"] / prompt_tokens}
    rows = []
    for r in results:
        rows.append([r["variant"], r["mean_s"], r["min_s"], r["cpu_mean_s"], r["sampled_tokens"],
                     r["peak_mib"]])
        figures[f"{r['variant']}_s"] = r["mean_s"]
        figures[f"{r['variant']}_cpu_s"] = r["cpu_mean_s"]
    by_name = {r["variant"]: r for r in results}
    if "episodes" in by_name:
        episodes = by_name["episodes"]
        figures["episodes_sampled_tokens_per_s"] = episodes["sampled_tokens"] / episodes["mean_s"]
        if "prefill" in by_name:
            figures["prefill_share"] = by_name["prefill"]["mean_s"] / episodes["mean_s"]
    memory = first["peak_kind"] + (" of the whole bench process" if args.in_process else "")
    caption = (f"{first['device']}, {first['dtype']}; {args.env} {json.dumps(args.options)}; "
               f"{args.batch} episodes, {args.group_size} per problem, prompts of "
               f"{min(lengths)}-{max(lengths)} tokens ({figures['repeated_prompt_share']:.0%} of "
               f"the prompt tokens repeat a prompt of their group); up to {args.max_new_tokens} "
               f"tokens per episode at T={args.temperature}; warm-up {args.warmup}, {args.steps} "
               f"timed runs; memory: {memory}\n{first['machine']}")
    common.print_table("episode generation: prefill against whole episodes",
                       ["variant", "s/run", "min s/run", "CPU s/run", "sampled tokens/run",
                        "peak MiB"], rows, caption)
    if "prefill_share" in figures:
        print(f"the prompts' prefill is {figures['prefill_share']:.0%} of an episode run's wall "
              f"time")
    common.print_figures("episode_generation", figures)
    common.write_json(args.json, {"bench": "episode_generation", "args": vars(args),
                                  "results": results, "figures": figures})


if __name__ == "__main__":
    main()
