"""Mixed precision: what fp32 and bf16 peers in one swarm do to spot-check errors and flag rates.

A swarm's peers pick their dtype from their own host (`host.dtype`: bf16 where the hardware has
it, else fp32), so a group sampled by a bf16 replica may be re-executed by an fp32 verifier and
trained on by a learner that autocasts to either. This measures, on the demo's model (SmolLM2,
2 stages) and task (sums prompts, groups of 8, 20 new tokens at temperature 1), for each pair
(the dtype that served the group, the dtype that re-executes it):
  - stage 0's hidden states: the relative error per position, |h_served - h_check| / |h_check|
    (what the secret sketches estimate, trust/commit.py; tolerance `max_error` 0.25 at a
    position, `max_mean_error` 0.03 over a session), both computed over the whole sequence;
  - the last stage: each sampled token's behaviour log-prob (as the serving replica produced it,
    decoding step by step) against the re-executed one, and its seeded sampling margin
    (rollout/sampling.py `sampling_margin`): the share over `trust.logprob_tolerance` and
    `trust.sampling_tolerance` (0.5 nats), and the share of groups that would fail a check (over
    `trust.max_mismatch_fraction`, 5% of its tokens, and over `trust.mismatched_tokens_allowed`,
    1 token);
  - the trainer's flags: rows whose mean log pi - log mu is over `trust.flag_log_ratio` (1.0)
    when the learner computes in the checking dtype (learn/losses.py `flagged_rows`).
One process, on the CPU, no network: the dtypes' numerics are the point, not the swarm.

Run: decentrl bench mixed-precision [--groups 16] [--max-new-tokens 20] [--threads 2] [--json P]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench import common

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PAIRS = (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="decentrl bench mixed-precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if min(args.groups, args.group_size, args.max_new_tokens, args.threads) < 1:
        parser.error("every count must be >= 1")
    return args


def full_pass(stages: list[Any], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stage 0's hidden states [B, T, H], the last stage's logits [B, T, V]) in fp32."""
    valid = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        hidden = stages[0](ids, positions, valid)
        x = hidden
        for stage in stages[1:]:
            x = stage(x, positions, valid)
    return hidden.float(), x.float()


def measure_pair(stages: dict[str, list[Any]], served: str, check: str, prompts: list[list[int]],
                 args: argparse.Namespace) -> dict[str, float]:
    from decentrl.config import TrustConfig
    from decentrl.rollout.chain import LocalChain, step_generator
    from decentrl.rollout.generate import generate, step_seed
    from decentrl.rollout.sampling import SamplingConfig, sampling_margin, sampling_noise
    from decentrl.trust.verify import too_many_mismatches

    trust = TrustConfig()
    sampling = SamplingConfig(temperature=1.0)
    errors, gaps, margins, row_ratios, failed_groups = [], [], [], [], 0
    for group, prompt in enumerate(prompts):
        seed = args.seed * 1_000_003 + group
        out = generate(LocalChain(stages[served]), [prompt] * args.group_size,
                       args.max_new_tokens, sampling, set(), 0, seed)
        ids = torch.tensor([prompt + g.tokens for g in out])
        behaviour = torch.tensor([g.logprobs for g in out])
        served_hidden, _ = full_pass(stages[served], ids)
        check_hidden, logits = full_pass(stages[check], ids)
        error = (served_hidden - check_hidden).norm(dim=-1) / check_hidden.norm(dim=-1)
        errors.append(error.flatten())
        start = len(prompt) - 1
        group_gaps, group_margins, group_ratios = [], [], []
        for step in range(args.max_new_tokens):
            column = logits[:, start + step]
            tokens = ids[:, start + step + 1]
            noise = sampling_noise(step_generator(step_seed(seed, step)), len(out),
                                   column.shape[-1])
            logprobs = column.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
            group_gaps.append((logprobs - behaviour[:, step]).abs())
            group_margins.append(sampling_margin(column, tokens, sampling, noise))
            group_ratios.append(logprobs - behaviour[:, step])
        gap, margin = torch.stack(group_gaps, 1), torch.stack(group_margins, 1)
        bad = (gap > trust.logprob_tolerance) | (margin > trust.sampling_tolerance)
        failed_groups += int(too_many_mismatches(int(bad.sum()), bad.numel(),
                                                 trust.max_mismatch_fraction,
                                                 trust.mismatched_tokens_allowed))
        row_ratios.append(torch.stack(group_ratios, 1).mean(1))  # per row, over its tokens
        gaps.append(gap.flatten())
        margins.append(margin.flatten())
    error, gap, margin = torch.cat(errors), torch.cat(gaps), torch.cat(margins)
    row_means = torch.cat(row_ratios)
    return {
        "hidden_error_mean": float(error.mean()), "hidden_error_p99": float(error.quantile(0.99)),
        "hidden_error_max": float(error.max()),
        "over_position_tolerance": float((error > 0.25).float().mean()),
        "logprob_gap_p99": float(gap.quantile(0.99)), "logprob_gap_max": float(gap.max()),
        "margin_p99": float(margin.quantile(0.99)), "margin_max": float(margin.max()),
        "tokens_over_tolerance": float(((gap > trust.logprob_tolerance)
                                        | (margin > trust.sampling_tolerance)).float().mean()),
        "groups_failing": failed_groups / len(prompts),
        "rows_flagged": float((row_means.abs() > 1.0).float().mean()),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from decentrl.model.loading import load_model
    from decentrl.model.stages import StagePlan, build_stages

    torch.set_num_threads(args.threads)
    common.quiet_transformers()
    model = load_model(common.bench_model(args.model))
    plan = StagePlan.even(model.spec.num_layers, 2)
    stages = {name: build_stages(model.spec, plan, model.tensors, torch.device("cpu"), dtype)
              for name, dtype in DTYPES.items()}
    prompts = common.sums_prompts(model.tokenizer, args.groups)
    rows, figures = [], {}
    for served, check in PAIRS:
        result = measure_pair(stages, served, check, prompts, args)
        print(f"  {served} served, {check} checks: {result}", flush=True)
        rows.append([served, check, result["hidden_error_mean"], result["hidden_error_p99"],
                     result["hidden_error_max"], result["logprob_gap_p99"],
                     result["logprob_gap_max"], result["margin_max"],
                     result["tokens_over_tolerance"], result["groups_failing"],
                     result["rows_flagged"]])
        figures.update({f"{served}_{check}_{k}": v for k, v in result.items()})
    common.print_table(
        "honest peers of mixed precision: spot-check errors and flags",
        ["served", "checked in", "hidden err mean", "p99", "max", "log-prob gap p99", "max",
         "margin max", "tokens over 0.5", "groups failing", "rows flagged"], rows,
        f"{model.spec.model_type}, 2 stages, {args.groups} groups x {args.group_size} rows x "
        f"{args.max_new_tokens} new tokens of sums prompts at T=1; tolerances: 0.25 a position, "
        f"0.5 nats a token, 5% of a group's tokens, flag at |mean log ratio| > 1")
    common.print_figures("mixed_precision", figures)
    common.write_json(args.json, {"bench": "mixed-precision", "args": vars(args),
                                  "figures": figures})


if __name__ == "__main__":
    main()
