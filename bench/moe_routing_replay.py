"""Rollout routing replay on tiny Qwen3-MoE and Mixtral decoders: behaviour KL and changed experts.

A policy-gradient learner's importance ratio pi_learner / pi_behaviour assumes the two policies
differ only by the update. In a mixture of experts the update also moves the routers, so many
sampled tokens go through other experts in the learner's forward than in the sampler's, and the
ratio drifts further. Rollout routing replay (R3, Ma et al. 2025) records the experts each
sampled token went to and makes the learner's forward use them (train.routing_replay): the
weights still come from the learner's router, so it keeps training.

The models are the real decoder: a tiny random model of each of `--families`, written by
transformers' config class (model/tiny.py; routers and experts drawn with std `--init`, so
routing is far from uniform), cut into `--stages` stages (model/stages.py), generating through
the KV cache (rollout/generate.py, recording the routing) and trained by the learner
(learn/trainer.py PipelineTrainer). Per family and seed:
  1. the policy samples `--batch` completions of `--length` tokens (temperature 1) of random
     prompts, and records each token's log-prob and its experts in every sparse layer;
  2. two learners, copies of it, take `--updates` optimizer steps (`--lr`, the run's grpo loss)
     on that batch (reward: the share of a completion's tokens in the first quarter of the
     vocabulary), one routing freely (arm `free`), one replaying the recorded routing (arm
     `replay`: the batch carries it, as `decentrl train` with train.routing_replay does);
  3. after each step k in `--report`, on the sampled tokens: the behaviour KL, mean over tokens
     of log p_behaviour - log p_learner (its k1 estimate; the learner's forward as its arm
     runs it), its k3 estimate (mean of r - 1 - log r, r = p_learner / p_behaviour), and the
     share of (token, layer) pairs, and of tokens in any layer, whose expert set under the
     learner's own router differs from the recorded one (the replay arm does not use its
     router's choice; the share says what it overrode).
Row `bf16 sampler` is the train/inference mismatch R3 was made for: the same weights in bf16
sample and record, the fp32 learner has taken no step.

Run: python -m bench.moe_routing_replay [--families qwen3_moe,mixtral] [--updates 8]
     [--report 1,2,4,8] [--seeds 3] [--batch 32] [--length 16] [--prompt 8] [--layers 4]
     [--experts 8] [--top-k 2] [--hidden 64] [--stages 2] [--init 0.1] [--lr 1e-4]
     [--threads 2] [--json PATH]
CPU, fp32 (the sampler of row `bf16 sampler` in bf16); about two minutes on two cores."""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import common
from decentrl.config import TrainConfig
from decentrl.learn.batch import TrainBatch, build_batch
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.stage_trainer import stage_forward
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import load_model
from decentrl.model.moe import FREE_ROUTE
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.model.tiny import make_tiny_model
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate, rollout_group
from decentrl.rollout.sampling import SamplingConfig, sampling_logprobs

ARMS = ("free", "replay")
BF16_ROW = "bf16 sampler"
SAMPLING = SamplingConfig()


def tiny_moe(family: str, folder: Path, seed: int, args: argparse.Namespace) -> Path:
    """A tiny random model of `family` written by transformers."""
    experts = {"num_experts_per_tok": args.top_k, "initializer_range": args.init}
    if family == "qwen3_moe":
        experts.update(num_experts=args.experts, moe_intermediate_size=args.hidden,
                       norm_topk_prob=False)
    else:
        experts.update(num_local_experts=args.experts, intermediate_size=args.hidden)
    return make_tiny_model(folder, seed=seed, num_layers=args.layers, hidden_size=args.hidden,
                           model_type=family, **experts)


def add_tiny_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """The tiny model's shape (`tiny_moe`) and its cut into stages."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages of the model")


def sample(stages: list[StageModule], seed: int, args: argparse.Namespace) -> TrainBatch:
    """`--batch` completions of random prompts, with their behaviour log-probs, rewards and
    recorded routing, as the batch the learner trains on."""
    generator = torch.Generator().manual_seed(seed)
    vocab = stages[0].spec.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=generator).tolist()
    rows = generate(LocalChain(stages), prompts, args.length, SAMPLING, set(), 0, seed=seed,
                    record_routing=True)
    rollouts = [rollout_group("bench", "bench", 0, prompt, [row], seed).rollouts[0]
                for prompt, row in zip(prompts, rows)]
    rewards = torch.tensor([sum(token < vocab // 4 for token in r.completion_tokens)
                            / len(r.completion_tokens) for r in rollouts])
    advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    return build_batch(rollouts, advantages, [0] * len(rollouts), 0, routing=True)


def without_routing(batch: TrainBatch) -> TrainBatch:
    return TrainBatch.from_tensors(batch.tensors())


@torch.no_grad()
def learner_logprobs(stages: list[StageModule], batch: TrainBatch) -> torch.Tensor:
    """log p of every sampled token under `stages`, replaying the batch's routing if it has
    one (the learner's forward, learn/trainer.py stage_forward)."""
    x: Any = (batch.prompts, batch.completions)
    for stage in stages:
        x = stage_forward(stage, x, batch)
    return sampling_logprobs(x, batch.completions[batch.completion_valid], SAMPLING)


@torch.no_grad()
def own_routing(stages: list[StageModule], batch: TrainBatch) -> torch.Tensor:
    """The experts the learner's own routers choose for every completion token
    [B, C, sparse layers, top_k]: prompt and completion in one forward (every row's prompt is
    as long, and no completion stops early)."""
    ids = torch.cat([batch.prompts[batch.prompt_of], batch.completions], dim=1)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    x, records = ids, []
    for stage in stages:
        x, experts = stage.body_routed(x, positions, valid)
        if experts is not None:
            records.append(experts)
    return torch.cat(records, dim=2)[:, batch.prompts.shape[1]:]


@dataclass
class Figures:
    """One measurement of a learner against the behaviour's samples."""

    kl: float  # k1: mean of log p_behaviour - log p_learner
    kl_k3: float  # k3: mean of r - 1 - log r, r = p_learner / p_behaviour (never negative)
    changed_pairs: float  # share of (token, layer) pairs whose experts changed
    changed_tokens: float  # share of tokens whose experts changed in some layer


def measure(stages: list[StageModule], batch: TrainBatch, replayed: bool) -> Figures:
    assert batch.routing is not None
    logprobs = learner_logprobs(stages, batch if replayed else without_routing(batch))
    log_ratio = batch.behaviour_logprobs[batch.completion_valid] - logprobs
    recorded = batch.routing
    changed = (own_routing(stages, batch).sort(-1).values != recorded.sort(-1).values).any(-1)
    read = (recorded != FREE_ROUTE).all(-1).all(-1)  # tokens a forward read (not the last)
    k3 = torch.expm1(-log_ratio) + log_ratio
    return Figures(kl=float(log_ratio.mean()), kl_k3=float(k3.mean()),
                   changed_pairs=float(changed[read].float().mean()),
                   changed_tokens=float(changed[read].any(-1).float().mean()))


def train_arm(policy: list[StageModule], batch: TrainBatch, replayed: bool,
              args: argparse.Namespace) -> dict[int, Figures]:
    """Learners copied from `policy` trained `args.updates` steps on `batch`; their figures
    after each reported step."""
    train = TrainConfig(lr=args.lr, micro_batch_size=args.batch, max_grad_norm=None,
                        routing_replay=replayed)
    trainer = PipelineTrainer.local(copy.deepcopy(policy), train,
                                    loss_config_from(train, args.length), SAMPLING,
                                    torch.float32)
    stages = [worker.stage for worker in trainer.stage_trainers]
    arm_batch = batch if replayed else without_routing(batch)
    results = {}
    for step in range(1, args.updates + 1):
        trainer.train_step(arm_batch)
        if step in args.report:
            results[step] = measure(stages, batch, replayed)
    return results


def run_seed(family: str, seed: int, args: argparse.Namespace) -> dict[str, dict[str, Figures]]:
    """{row: {arm: figures}} of one family and seed."""
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(str(tiny_moe(family, Path(folder) / family, seed, args)))
    plan = StagePlan.even(model.spec.num_layers, args.stages)
    policy = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)
    torch.manual_seed(seed)
    batch = sample(policy, seed, args)
    trained = {arm: train_arm(policy, batch, arm == "replay", args) for arm in ARMS}
    rows = {f"{step} step(s)": {arm: trained[arm][step] for arm in ARMS}
            for step in sorted(args.report)}
    sampler = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.bfloat16)
    low_batch = sample(sampler, seed + 1000, args)
    rows[BF16_ROW] = {arm: measure(policy, low_batch, arm == "replay") for arm in ARMS}
    return rows


def mean_figures(runs: list[Figures]) -> Figures:
    return Figures(*(statistics.fmean(getattr(run, field) for run in runs)
                     for field in ("kl", "kl_k3", "changed_pairs", "changed_tokens")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench moe-routing-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_moe,mixtral")
    parser.add_argument("--updates", type=int, default=8, help="optimizer steps per arm")
    parser.add_argument("--report", default="1,2,4,8", help="steps after which to measure")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16, help="sampled tokens per sequence")
    parser.add_argument("--prompt", type=int, default=8, help="tokens per random prompt")
    add_tiny_moe_arguments(parser)
    parser.add_argument("--init", type=float, default=0.1,
                        help="std of the tiny model's weights (routers included)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    args.report = {int(step) for step in args.report.split(",")}
    if not args.report or min(args.report) < 1 or max(args.report) > args.updates:
        parser.error(f"--report steps must lie in [1, --updates={args.updates}]")
    if args.seeds < 1 or args.batch < 2 or args.length < 2 or args.prompt < 1:
        parser.error("--seeds >= 1, --batch >= 2, --length >= 2 and --prompt >= 1 are needed")
    if not 1 <= args.stages <= args.layers:
        parser.error(f"--stages must lie in [1, --layers={args.layers}]")
    torch.set_num_threads(args.threads)
    table, figures = [], {}
    for family in args.families.split(","):
        runs = [run_seed(family, seed, args) for seed in range(args.seeds)]
        for row in runs[0]:
            free = mean_figures([run[row]["free"] for run in runs])
            replay = mean_figures([run[row]["replay"] for run in runs])
            table.append([family, row, free.kl, replay.kl, free.kl_k3, replay.kl_k3,
                          free.changed_pairs, free.changed_tokens, replay.changed_pairs])
            key = f"{family}_{'bf16' if row == BF16_ROW else row.split()[0] + 'step'}"
            figures.update({f"{key}_kl_free": free.kl, f"{key}_kl_replay": replay.kl,
                            f"{key}_k3_free": free.kl_k3, f"{key}_k3_replay": replay.kl_k3,
                            f"{key}_changed_free": free.changed_pairs,
                            f"{key}_changed_replay": replay.changed_pairs})
    common.print_table(
        f"behaviour vs learner on the sampled tokens ({args.seeds} seeds, {args.batch} x "
        f"{args.length} tokens, {args.layers} layers in {args.stages} stages, {args.experts} "
        f"experts, top-{args.top_k})",
        ["family", "learner", "KL free", "KL replay", "k3 free", "k3 replay",
         "changed pairs free", "changed tokens free", "changed pairs replay"], table,
        caption="KL: mean of log p_behaviour - log p_learner; k3: mean of r - 1 - log r, "
                "r = p_learner / p_behaviour. changed: share of (token, layer) "
                "pairs / tokens whose expert set under the learner's router differs from the "
                "recorded one (under replay the recorded experts run regardless).")
    common.print_figures("moe_routing_replay", figures)
    common.write_json(args.json, {"figures": figures, "rows": table})


if __name__ == "__main__":
    main()
