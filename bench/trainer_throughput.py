"""One policy update: the pipeline against plain PyTorch.

Trainer throughput: one policy update (GRPO loss, the same batch) through decentrl's
PipelineTrainer versus a plain single-module PyTorch loop over Hugging Face's
AutoModelForCausalLM loaded from the same folder.

Both sides: fp32 master weights, autocast to `compute_dtype(device)` (bf16 where the hardware has
it), AdamW with the TrainConfig defaults, log-probs of the same completion tokens through
`sampling_logprobs`, the same `policy_loss` call, backward, global grad-norm clip at 1.0, step.
The batch is `--batch` random completions of `--completion-length` tokens after sums-task prompts,
`--group-size` completions per prompt (built with `build_batch`); its behaviour log-probs are the
variant's own log-probs before the first step, so the data is on-policy as after a fresh rollout.
One micro-batch holds the batch. With the default group size 1 every variant does the same work;
with G > 1 decentrl runs each shared prompt once per group (model/prefix.py) while the plain loop
runs it once per completion, so decentrl then does less work, by design. "tokens/s" always counts
the tokens of the full per-completion sequences (prompt + completion), the plain loop's work.

Variants (`--variants`):
  decentrl      PipelineTrainer over `--stages` stages (head untied from the embedding by design)
  plain         HF model as shipped (tied head): model(...).logits, then the target positions
  plain-head    same, but the head runs on the target positions only (as decentrl does)
  plain-untied  plain-head with the head untied from the embedding (decentrl's parameter set)

Each variant runs in a fresh process unless --in-process (so a CPU peak RSS is its own).
Run: python -m bench.trainer_throughput [--device auto] [--steps 3] [--batch 16] [--model PATH]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch

from bench import common

VARIANTS = ("decentrl", "plain", "plain-head", "plain-untied")
DEFAULT_VARIANTS = "decentrl,plain,plain-head"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("trainer_throughput", __doc__, "step")
    parser.add_argument("--completion-length", type=int, default=112)
    parser.add_argument("--group-size", type=int, default=1,
                        help="completions per prompt (decentrl runs a shared prompt once; 1 "
                             "gives every variant the same work)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, from {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if min(args.steps, args.batch, args.completion_length, args.group_size, args.stages) < 1 \
            or args.warmup < 0:
        parser.error("--steps, --batch, --completion-length, --group-size and --stages must be "
                     ">= 1, --warmup >= 0")
    return args


def make_batch(loaded: Any, batch: int, completion_length: int, group_size: int, seed: int):
    """`batch` completions of `batch / group_size` sums prompts (each prompt shared by a group),
    every completion random tokens; behaviour log-probs are filled in later."""
    from decentrl.learn.batch import build_batch
    from decentrl.rollout.types import Rollout
    from decentrl.tasks import make_task, problems, render_prompt

    task = make_task("sums")
    groups = -(-batch // group_size)
    prompts = [render_prompt(task, p, loaded.tokenizer) for p in problems(task, "train", groups)]
    generator = torch.Generator().manual_seed(seed)
    completions = torch.randint(0, loaded.spec.vocab_size, (batch, completion_length),
                                generator=generator).tolist()
    rollouts = [Rollout(prompt_tokens=prompts[row // group_size], completion_tokens=c,
                        behaviour_logprobs=[0.0] * len(c), finished=False)
                for row, c in enumerate(completions)]
    advantages = torch.randn(batch, generator=generator).tolist()
    return build_batch(rollouts, advantages, [0] * batch, loaded.tokenizer.pad_token_id)


def full_sequences(b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain layout: every row its own prompt + completion, [B, P + C] tokens, mask and
    positions. The logits at positions P - 1 .. P + C - 2 predict the completion tokens."""
    return (torch.cat([b.prompts[b.prompt_of], b.completions], 1),
            torch.cat([b.prompt_valid[b.prompt_of], b.completion_valid], 1),
            torch.cat([b.prompt_positions[b.prompt_of], b.completion_positions], 1))


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def decentrl_variant(loaded, batch, args, device, dtype):
    """(step function, behaviour log-probs [B, L], parameter count)."""
    from decentrl.config import TrainConfig
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.learn.stage_trainer import stage_forward
    from decentrl.learn.trainer import PipelineTrainer
    from decentrl.model.stages import StagePlan, build_stages
    from decentrl.rollout.sampling import SamplingConfig, sampling_logprobs

    plan = StagePlan.even(loaded.spec.num_layers, args.stages)
    stages = build_stages(loaded.spec, plan, loaded.tensors, device, torch.float32)
    train = TrainConfig(micro_batch_size=batch.num_sequences)
    sampling = SamplingConfig()
    trainer = PipelineTrainer.local(stages, train, loss_config_from(train, args.completion_length),
                                    sampling, dtype)
    on_device = batch.to(device)
    mask = on_device.completion_valid
    with torch.no_grad(), autocast(device, dtype):
        x = (on_device.prompts, on_device.completions)
        for stage in stages:
            x = stage_forward(stage, x, on_device)
    behaviour = torch.zeros(mask.shape)
    behaviour[mask.cpu()] = sampling_logprobs(
        x, on_device.completions[mask], sampling).float().cpu()
    params = sum(p.numel() for s in stages for p in s.parameters())

    def step(train_batch):
        metrics = trainer.train_step(train_batch)
        return metrics["policy_loss"], metrics["grad_norm"]

    return step, behaviour, params


def plain_variant(loaded, batch, args, device, dtype, variant):
    from transformers import AutoModelForCausalLM

    from decentrl.config import TrainConfig
    from decentrl.learn.losses import policy_loss
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.rollout.sampling import SamplingConfig, sampling_logprobs

    model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).to(device)
    if variant == "plain-untied":
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(
            model.get_input_embeddings().weight.detach().clone())
    model.train()
    train = TrainConfig(micro_batch_size=batch.num_sequences)
    loss_config = loss_config_from(train, args.completion_length)
    sampling = SamplingConfig()
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=train.betas,
                                  weight_decay=train.weight_decay)
    head_on_targets = variant != "plain"

    def target_logits(b):
        tokens, valid, positions = full_sequences(b)
        predicting = slice(b.prompts.shape[1] - 1, tokens.shape[1] - 1)
        if head_on_targets:
            hidden = model.model(input_ids=tokens, attention_mask=valid.long(),
                                 position_ids=positions, use_cache=False).last_hidden_state
            return model.lm_head(hidden[:, predicting][b.completion_valid])
        logits = model(input_ids=tokens, attention_mask=valid.long(), position_ids=positions,
                       use_cache=False).logits
        return logits[:, predicting][b.completion_valid]

    def step(b):
        mask = b.completion_valid
        with autocast(device, dtype):
            logits = target_logits(b)
        flat = sampling_logprobs(logits, b.completions[mask], sampling)
        logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        logprobs = logprobs.masked_scatter(mask, flat)
        loss, metrics = policy_loss(logprobs, logprobs.detach(), b.behaviour_logprobs,
                                    b.advantages, mask, loss_config,
                                    total_sequences=b.num_sequences,
                                    total_tokens=b.num_target_tokens)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return metrics["policy_loss"], float(norm)

    on_device = batch.to(device)
    mask = on_device.completion_valid
    with torch.no_grad(), autocast(device, dtype):
        logits = target_logits(on_device)
    behaviour = torch.zeros(mask.shape)
    behaviour[mask.cpu()] = sampling_logprobs(
        logits, on_device.completions[mask], sampling).float().cpu()
    params = sum(p.numel() for p in model.parameters())
    return step, behaviour, params


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    loaded, device, dtype = common.variant_setup(args)
    torch.manual_seed(args.seed)
    batch = make_batch(loaded, args.batch, args.completion_length, args.group_size, args.seed)
    if variant == "decentrl":
        step, behaviour, params = decentrl_variant(loaded, batch, args, device, dtype)
    else:
        step, behaviour, params = plain_variant(loaded, batch, args, device, dtype, variant)
    loaded.tensors.clear()  # the variant holds its own copy now
    batch.behaviour_logprobs = behaviour
    batch = batch.to(device)
    common.reset_peak_memory(device)
    losses: list[tuple[float, float]] = []
    seconds = common.time_calls(lambda: losses.append(step(batch)), device, args.warmup,
                                args.steps)
    peak, peak_kind = common.peak_memory_mib(device)
    if args.profile:
        common.profile(lambda: step(batch), device, variant)
    # Tokens of the full sequences (a shared prompt counted once per completion, as the plain
    # loop processes it), so "tokens/s" means the same work on every variant.
    tokens = int(full_sequences(batch)[1].sum())
    completion = batch.num_target_tokens
    stats = common.summary(seconds)
    return {
        "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "params": params, "tokens": tokens, "completion_tokens": completion,
        "padded_length": batch.prompts.shape[1] + batch.completions.shape[1], **stats,
        "tokens_per_s": tokens / stats["mean_s"],
        "completion_tokens_per_s": completion / stats["mean_s"],
        "peak_mib": peak, "peak_kind": peak_kind,
        "first_loss": losses[0][0], "first_grad_norm": losses[0][1],
        "machine": common.machine(device),
    }


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = results[0]
    rows = [[r["variant"], r["tokens_per_s"], r["completion_tokens_per_s"], r["mean_s"],
             r["min_s"], r["cpu_mean_s"], r["peak_mib"], r["params"] / 1e6, r["first_loss"],
             r["first_grad_norm"]] for r in results]
    memory = first["peak_kind"] + (" of the whole bench process" if args.in_process else "")
    caption = (f"{first['device']}, autocast {first['dtype']}; group size {args.group_size}; "
               f"batch {args.batch} x "
               f"{first['padded_length']} padded ({first['tokens']} real tokens, "
               f"{first['completion_tokens']} completion); warm-up {args.warmup}, mean of "
               f"{args.steps} steps; memory: {memory}\n{first['machine']}")
    common.print_table("trainer throughput: one GRPO policy update",
                       ["variant", "tokens/s", "completion tok/s", "s/step", "min s/step",
                        "CPU s/step", "peak MiB", "params M", "loss", "grad norm"], rows, caption)
    figures: dict[str, float] = {}
    for r in results:
        key = r["variant"].replace("-", "_")
        figures[f"{key}_tokens_per_s"] = r["tokens_per_s"]
        figures[f"{key}_completion_tokens_per_s"] = r["completion_tokens_per_s"]
        figures[f"{key}_s_per_step"] = r["mean_s"]
        figures[f"{key}_peak_mib"] = r["peak_mib"]
    by_name = {r["variant"]: r for r in results}
    if "decentrl" in by_name:
        for other in ("plain", "plain-head", "plain-untied"):
            if other in by_name:
                ours, theirs = by_name["decentrl"], by_name[other]
                ratio = theirs["mean_s"] / ours["mean_s"]
                best = theirs["min_s"] / ours["min_s"]
                cpu = theirs["cpu_mean_s"] / ours["cpu_mean_s"]
                key = other.replace("-", "_")
                figures[f"ratio_decentrl_vs_{key}"] = ratio
                figures[f"best_ratio_decentrl_vs_{key}"] = best
                figures[f"cpu_ratio_decentrl_vs_{key}"] = cpu
                print(f"decentrl / {other} throughput: {ratio:.3f} (mean wall), {best:.3f} (best "
                      f"step), {cpu:.3f} (CPU time); target >= 0.90")
    common.print_figures("trainer_throughput", figures)
    common.write_json(args.json, {"bench": "trainer_throughput", "args": vars(args),
                                  "results": results, "figures": figures})


if __name__ == "__main__":
    main()
