"""Int8 base: a LoRA run's frozen base in int8 against bf16 and fp32: memory, speed, numerics.

A LoRA run's frozen projections can be held as int8 with one fp32 scale per output row
(`train.lora_base = "int8"`, model/quant.py) instead of in the compute dtype. This builds, for
each variant (`--variants`, default `fp32,bf16,int8`; `int8-fp32` also exists: the int8 base
computed in fp32, which separates the quantization's error from bf16's rounding), both stages of
a `--stages` plan of `--model` with LoRA rank `--rank` as a training-and-serving peer does: the
learner `load_stage(config, i, device, fp32, frozen_dtype=compute)` (fp32 master adapters, the
base in the compute dtype or int8) and its serving copy `lora_serving_copy` (the very same base
tensors, adapters in the compute dtype). Variants: fp32 (base and compute fp32), bf16 (base and
compute bf16), int8 (int8 base, compute bf16), int8-fp32 (int8 base, compute fp32). Per variant:
  1. memory, counted from the tensors (not the process): the frozen base (every frozen parameter
     and buffer, held once for both roles), the LoRA-wrapped projections' weights alone (with
     their int8 scales), the learner's fp32 adapters and the serving copy's adapters;
  2. generation: greedy decoding (decentrl `generate` over a LocalChain of the serving copies,
     no stop ids) of `--batch` rows of `--prompt-length` random prompt tokens, exactly
     `--max-new-tokens` new tokens a row; `--warmup` untimed runs, then the best (and mean) of
     `--steps` timed ones;
  3. training: one LoRA update (PipelineTrainer.local over the learners, autocast to the compute
     dtype as a training peer does, GRPO loss, backward, global clip, AdamW on the adapters) on
     the same rows: the prompts and, as completions, the fp32 variant's greedy tokens, behaviour
     log-probs the variant's own, random advantages, one micro-batch; best and mean of
     `--steps` timed steps after `--warmup`;
  4. numerics: the last stage's log-prob of every completion token of that batch (the serving
     copies, whole-sequence forward, as a verifier re-executes), max and mean |difference|
     against the fp32 variant's, and the share of greedy rows identical to fp32's. Adapters are
     fresh (B = 0), so this is the base's quality: every peer of a run holds the same int8 base,
     so spot-checks compare like with like whatever these differences are.
One process, no network; the fp32 variant always runs first (it is the reference).

Run: decentrl bench int8-base [--model M] [--rank 16] [--batch 8] [--threads 1] [--json P]
"""

from __future__ import annotations

import argparse
import gc
import math
from typing import Any

import torch

from bench import common

# variant -> (train.lora_base, compute dtype)
VARIANTS: dict[str, tuple[str, torch.dtype]] = {
    "fp32": ("compute", torch.float32), "bf16": ("compute", torch.bfloat16),
    "int8": ("int8", torch.bfloat16), "int8-fp32": ("int8", torch.float32)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from decentrl.model.loading import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="decentrl bench int8-base", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model name, HF folder, or tiny (a tiny random model)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--variants", default="fp32,bf16,int8",
                        help=f"comma-separated, from {', '.join(VARIANTS)} (fp32 always runs)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="rows (generation and training)")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed repeats of each measure")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    if any(v not in VARIANTS for v in names):
        parser.error(f"--variants must name some of {', '.join(VARIANTS)}")
    args.variants = ["fp32"] + [v for v in dict.fromkeys(names) if v != "fp32"]
    if min(args.rank, args.stages, args.batch, args.prompt_length, args.max_new_tokens,
           args.steps, args.threads) < 1 or args.warmup < 0:
        parser.error("every count must be >= 1 (--warmup >= 0)")
    return args


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of `tensors`, a tensor shared by several names counted once."""
    seen = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(size for _, size in seen)


def memory(learners: list[Any], served: list[Any]) -> dict[str, float]:
    """Bytes of the frozen base, of the LoRA-wrapped projections' weights (int8: with their
    scales), of the learner's adapters and of the serving copy's adapters, over every stage."""
    from decentrl.model.lora import LoRALinear, lora_tensors

    frozen, adapters, projections, served_adapters = [], [], [], []
    for learner, copy in zip(learners, served, strict=True):
        for param in learner.parameters():
            (adapters if param.requires_grad else frozen).append(param)
        frozen.extend(learner.buffers())
        for module in learner.modules():
            if isinstance(module, LoRALinear):
                projections.append(module.weight)
                if module.int8:
                    projections.append(module.weight_scale)
        served_adapters.extend(lora_tensors(copy).values())
    return {"frozen_bytes": tensor_bytes(frozen), "projection_bytes": tensor_bytes(projections),
            "adapter_bytes": tensor_bytes(adapters),
            "served_adapter_bytes": tensor_bytes(served_adapters)}


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, seed: int
               ) -> Any:
    """The training rows: each prompt with its completion, random advantages; the behaviour
    log-probs are filled in by the caller."""
    from decentrl.learn.batch import build_batch
    from decentrl.rollout.types import Rollout

    rollouts = [Rollout(prompt_tokens=p, completion_tokens=c, behaviour_logprobs=[0.0] * len(c),
                        finished=False) for p, c in zip(prompts, completions, strict=True)]
    advantages = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(seed))
    return build_batch(rollouts, advantages.tolist(), [0] * len(rollouts), pad_id)


def target_logprobs(stages: list[Any], batch: Any) -> torch.Tensor:
    """Log-probs [B, C] of the batch's completion tokens under `stages` (whole sequences, no
    gradient), through the trainer's own stage_forward and sampling_logprobs."""
    from decentrl.learn.stage_trainer import stage_forward
    from decentrl.rollout.sampling import SamplingConfig, sampling_logprobs

    mask = batch.completion_valid
    with torch.no_grad():
        x: Any = (batch.prompts, batch.completions)
        for stage in stages:
            x = stage_forward(stage, x, batch)
    out = torch.zeros(mask.shape)
    out[mask.cpu()] = sampling_logprobs(x, batch.completions[mask], SamplingConfig()).float().cpu()
    return out


def run_variant(name: str, folder: str, prompts: list[list[int]], pad_id: int,
                reference: dict[str, Any] | None, args: argparse.Namespace,
                device: torch.device) -> dict[str, Any]:
    from dataclasses import replace

    from decentrl.config import parse_config
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.learn.trainer import PipelineTrainer
    from decentrl.model.run_stage import load_stage, lora_serving_copy
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig

    base, dtype = VARIANTS[name]
    config = parse_config({"name": "int8-base", "model": folder, "num_stages": args.stages,
                           "seed": args.seed, "train": {"lora_rank": args.rank, "lora_base": base,
                                                        "micro_batch_size": args.batch}})
    learners = [load_stage(config, i, device, torch.float32, frozen_dtype=dtype)
                for i in range(args.stages)]
    served = [lora_serving_copy(config, learner, dtype) for learner in learners]
    result: dict[str, Any] = {"variant": name, "base": base,
                              "compute": str(dtype).removeprefix("torch."),
                              **memory(learners, served)}

    chain, outputs = LocalChain(served), []
    greedy = SamplingConfig(temperature=0.0)

    def decode() -> None:
        outputs.append(generate(chain, prompts, args.max_new_tokens, greedy, set(), pad_id,
                                args.seed))
    seconds = common.summary(common.time_calls(decode, device, args.warmup, args.steps))
    tokens = [g.tokens for g in outputs[-1]]
    if sum(map(len, tokens)) != args.batch * args.max_new_tokens:
        raise RuntimeError(f"{name}: {sum(map(len, tokens))} new tokens, expected "
                           f"{args.batch * args.max_new_tokens}")
    new_tokens = args.batch * args.max_new_tokens
    result.update(new_tokens_per_s=new_tokens / seconds["min_s"],
                  mean_new_tokens_per_s=new_tokens / seconds["mean_s"], tokens=tokens)

    batch = make_batch(prompts, reference["tokens"] if reference else tokens, pad_id, args.seed)
    logprobs = target_logprobs(served, batch.to(device))
    result["logprobs"] = logprobs
    if reference is not None:
        gap = (logprobs - reference["logprobs"]).abs()[batch.completion_valid]
        same = sum(a == b for a, b in zip(tokens, reference["tokens"], strict=True))
        result.update(logprob_diff_max=float(gap.max()), logprob_diff_mean=float(gap.mean()),
                      greedy_same_rows=same / args.batch)
    else:
        result.update(logprob_diff_max=0.0, logprob_diff_mean=0.0, greedy_same_rows=1.0)

    trainer = PipelineTrainer.local(learners, config.train,
                                    loss_config_from(config.train, args.max_new_tokens),
                                    SamplingConfig(), dtype)
    train_batch = replace(batch, behaviour_logprobs=logprobs).to(device)
    losses: list[float] = []
    step = common.summary(common.time_calls(
        lambda: losses.append(trainer.train_step(train_batch)["policy_loss"]), device,
        args.warmup, args.steps))
    if not all(math.isfinite(loss) for loss in losses):
        raise RuntimeError(f"{name}: a training step's loss is not finite: {losses}")
    result.update(train_step_s=step["min_s"], mean_train_step_s=step["mean_s"])
    print(f"  {name}: {result['new_tokens_per_s']:.1f} new tok/s, train step "
          f"{result['train_step_s']:.3f} s, log-prob |diff| max {result['logprob_diff_max']:.3g}",
          flush=True)
    return result


FIGURES = ("frozen_bytes", "projection_bytes", "adapter_bytes", "served_adapter_bytes",
           "new_tokens_per_s", "mean_new_tokens_per_s", "train_step_s", "mean_train_step_s",
           "logprob_diff_max", "logprob_diff_mean", "greedy_same_rows")


def report(results: list[dict[str, Any]], args: argparse.Namespace, machine: str,
           spec: Any) -> dict[str, float]:
    """Print the memory table and the speed and numerics table; the figures by name."""
    mib = 2 ** 20
    by_name = {r["variant"]: r for r in results}
    bf16, int8 = by_name.get("bf16"), by_name.get("int8")
    memory_rows, speed_rows, figures = [], [], {}
    for r in results:
        share = r["projection_bytes"] / bf16["projection_bytes"] if bf16 else float("nan")
        memory_rows.append([r["variant"], r["base"], r["compute"], r["frozen_bytes"] / mib,
                            r["projection_bytes"] / mib, share, r["adapter_bytes"] / mib,
                            r["served_adapter_bytes"] / mib])
        speed_rows.append([r["variant"], r["new_tokens_per_s"], r["mean_new_tokens_per_s"],
                           r["train_step_s"], r["mean_train_step_s"], r["logprob_diff_max"],
                           r["logprob_diff_mean"], r["greedy_same_rows"]])
        key = r["variant"].replace("-", "_")
        figures.update({f"{key}_{name}": float(r[name]) for name in FIGURES})
    if int8 and bf16:
        for name in ("projection_bytes", "frozen_bytes", "new_tokens_per_s", "train_step_s"):
            figures[f"int8_vs_bf16_{name}"] = int8[name] / bf16[name]
    common.print_table(
        "LoRA frozen base: memory of every stage's tensors",
        ["variant", "base", "compute", "frozen base MiB", "projections MiB", "/ bf16's",
         "adapters MiB (fp32 master)", "served adapters MiB"], memory_rows,
        f"{spec.model_type}, {spec.num_layers} layers in {args.stages} stages, LoRA rank "
        f"{args.rank}; frozen base: every frozen parameter and buffer, held once for both roles; "
        f"projections: the adapted projections' weights (int8: with their fp32 row scales)")
    common.print_table(
        "LoRA frozen base: generation, a training step, log-probs against fp32",
        ["variant", "new tok/s (best)", "mean", "train s/step (best)", "mean",
         "log-prob |diff| max", "mean", "greedy rows = fp32's"], speed_rows,
        f"greedy: {args.batch} rows of {args.prompt_length} random prompt tokens, exactly "
        f"{args.max_new_tokens} new tokens; training: one LoRA update on those rows with fp32's "
        f"completions, one micro-batch; log-probs of those "
        f"{args.batch * args.max_new_tokens} completion tokens; warm-up {args.warmup}, "
        f"{args.steps} timed\n{machine}")
    return figures


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from decentrl.device import pick_device
    from decentrl.model.loading import load_tokenizer, model_spec, resolve_model

    torch.set_num_threads(args.threads)
    common.quiet_transformers()
    device = pick_device(args.device)
    folder = common.bench_model(args.model)
    spec, tokenizer = model_spec(resolve_model(folder)), load_tokenizer(resolve_model(folder))
    generator = torch.Generator().manual_seed(args.seed)
    vocab = min(spec.vocab_size, len(tokenizer))
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_length),
                            generator=generator).tolist()
    results: list[dict[str, Any]] = []
    for name in args.variants:
        print(f"running {name} ...", flush=True)
        results.append(run_variant(name, folder, prompts, tokenizer.pad_token_id,
                                   results[0] if results else None, args, device))
        gc.collect()
    figures = report(results, args, common.machine(device), spec)
    common.print_figures("int8_base", figures)
    kept = [{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in results]
    common.write_json(args.json, {"bench": "int8-base", "args": vars(args), "figures": figures,
                                  "variants": kept})


if __name__ == "__main__":
    main()
