"""Generation throughput against Hugging Face generate.

Generation throughput: decentrl's `generate` over a LocalChain of `--stages` stages versus
Hugging Face `model.generate`, on the same model folder, the same dtype (`compute_dtype(device)`:
bf16 where the hardware has it), the same batch of `--batch` left-padded sums prompts, and
`--max-new-tokens` new tokens.

Fair length: both sides ignore end-of-sequence (decentrl gets no stop ids, HF gets
eos_token_id=None), so every row decodes exactly max_new_tokens tokens on both and the
new-token count is batch x max_new_tokens for both. Counting "real tokens up to eos" instead
would compare different amounts of work, since the two samplers draw different sequences.

Modes (`--modes`): `sample` (temperature 1, no top-k/top-p cut, fixed seed: torch.Generator for
decentrl, torch.manual_seed for HF) and `greedy`. decentrl also returns the behaviour log-prob of
every token (HF is not asked for scores): that is part of decentrl's job, so it is timed.
Greedy outputs are compared row by row as a sanity check (bf16 rounding differs between the two
implementations, so a late divergence is possible without a bug).

Run: python -m bench.generation [--device auto] [--steps 3] [--batch 16] [--model PATH]
"""

from __future__ import annotations

import argparse
from typing import Any

from bench import common

VARIANTS = ("decentrl", "hf")
MODES = ("sample", "greedy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("generation", __doc__, "generation")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: sample,greedy")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: decentrl,hf")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        parser.error(f"--modes must name some of {', '.join(MODES)}")
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.max_new_tokens < 1:
        parser.error("--steps, --batch and --max-new-tokens must be >= 1, --warmup >= 0")
    return args


def decentrl_generator(loaded, prompts, args, device, dtype):
    """A function mode -> generated token rows ([B, max_new_tokens] lists)."""
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig

    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    chain = LocalChain(build_stages(loaded.spec, plan, loaded.tensors, device, dtype))
    pad_id = loaded.tokenizer.pad_token_id

    def run(mode: str) -> list[list[int]]:
        sampling = SamplingConfig(temperature=0.0 if mode == "greedy" else 1.0)
        # No stop ids: every row decodes exactly max_new_tokens (see the module docstring).
        out = generate(chain, prompts, args.max_new_tokens, sampling, set(), pad_id, args.seed)
        return [g.tokens for g in out]

    return run


def hf_generator(loaded, prompts, args, device, dtype):
    model = common.hf_generation_model(loaded.path, device, dtype)
    pad_id = loaded.tokenizer.pad_token_id

    def run(mode: str) -> list[list[int]]:
        return common.hf_generate(model, prompts, pad_id, args.max_new_tokens,
                                  mode == "sample", args.seed)

    return run


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded, device, dtype = common.variant_setup(args)
    prompts = common.sums_prompts(loaded.tokenizer, args.batch)
    make = decentrl_generator if variant == "decentrl" else hf_generator
    run = make(loaded, prompts, args, device, dtype)
    loaded.tensors.clear()
    common.reset_peak_memory(device)
    result: dict[str, Any] = {
        "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "prompt_lengths": [len(p) for p in prompts], "machine": common.machine(device),
        "modes": {},
    }
    for mode in args.modes:
        outputs: list[list[list[int]]] = []
        seconds = common.time_calls(lambda: outputs.append(run(mode)), device, args.warmup,
                                    args.steps)
        new_tokens = sum(len(row) for row in outputs[-1])
        if new_tokens != args.batch * args.max_new_tokens:
            raise RuntimeError(f"{variant} {mode}: {new_tokens} new tokens, expected "
                               f"{args.batch * args.max_new_tokens}")
        stats = common.summary(seconds)
        result["modes"][mode] = {**stats, "new_tokens": new_tokens,
                                 "new_tokens_per_s": new_tokens / stats["mean_s"],
                                 "best_new_tokens_per_s": new_tokens / stats["min_s"],
                                 "tokens": outputs[-1]}
        if args.profile:
            common.profile(lambda: run(mode), device, f"{variant} {mode}")
    result["peak_mib"], result["peak_kind"] = common.peak_memory_mib(device)
    return result


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = results[0]
    rows = []
    figures: dict[str, float] = {}
    for mode in args.modes:
        for r in results:
            m = r["modes"][mode]
            rows.append([f"{r['variant']} {mode}", m["new_tokens_per_s"],
                         m["best_new_tokens_per_s"], m["mean_s"], m["min_s"], m["cpu_mean_s"],
                         r["peak_mib"]])
            figures[f"{r['variant']}_{mode}_new_tokens_per_s"] = m["new_tokens_per_s"]
            figures[f"{r['variant']}_{mode}_best_new_tokens_per_s"] = m["best_new_tokens_per_s"]
    memory = first["peak_kind"] + (" of the whole bench process" if args.in_process else "")
    lengths = first["prompt_lengths"]
    caption = (f"{first['device']}, {first['dtype']}; {args.batch} prompts of {min(lengths)}-"
               f"{max(lengths)} tokens, left-padded; exactly {args.max_new_tokens} new tokens per "
               f"row (eos ignored on both sides); warm-up {args.warmup}, {args.steps} timed runs "
               f"per mode; memory: {memory}\n{first['machine']}")
    common.print_table("generation: new tokens/s",
                       ["variant / mode", "new tok/s (mean)", "new tok/s (best)", "s/run",
                        "min s/run", "CPU s/run", "peak MiB"], rows, caption)
    by_name = {r["variant"]: r for r in results}
    if "decentrl" in by_name and "hf" in by_name:
        for mode in args.modes:
            ours, theirs = by_name["decentrl"]["modes"][mode], by_name["hf"]["modes"][mode]
            ratio = theirs["mean_s"] / ours["mean_s"]
            best = theirs["min_s"] / ours["min_s"]
            cpu = theirs["cpu_mean_s"] / ours["cpu_mean_s"]
            figures[f"ratio_{mode}"] = ratio
            figures[f"best_ratio_{mode}"] = best
            figures[f"cpu_ratio_{mode}"] = cpu
            print(f"{mode}: decentrl / HF new tokens/s: {ratio:.3f} (mean wall), {best:.3f} "
                  f"(best run), {cpu:.3f} (CPU time); target >= 1")
        if "greedy" in args.modes:
            a = by_name["decentrl"]["modes"]["greedy"]["tokens"]
            b = by_name["hf"]["modes"]["greedy"]["tokens"]
            same = sum(x == y for x, y in zip(a, b))
            prefixes = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                        for x, y in zip(a, b)]
            figures["greedy_identical_rows"] = same
            print(f"greedy: {same}/{len(a)} rows identical to HF; rows agree on their first "
                  f"{sum(prefixes) / len(prefixes):.1f} tokens on average (min {min(prefixes)})")
    common.print_figures("generation", figures)
    for r in results:
        for m in r["modes"].values():
            m.pop("tokens", None)
    common.write_json(args.json, {"bench": "generation", "args": vars(args), "results": results,
                                  "figures": figures})


if __name__ == "__main__":
    main()
