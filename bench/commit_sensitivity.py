"""How small a lie in the activations the coordinator's secret sketches still catch.

A stage's reply is its commitment; the coordinator keeps a secret random sketch of every hidden
state it delivered, at every position (trust/commit.py), and a spot-check compares it with the
same sketch of a re-execution on another replica. This measures, on stage 0 of each `--models`
(the first half of the layers):

- honest error, worst and mean over positions: KV-cache decoding of a left-padded batch (a
  prefill of 8 columns, then one column per step) against teacher-forced recomputation of the
  batch with 3 more padding columns, bf16 against fp32 and fp32 against bf16, with the hidden
  states crossing the bf16 or the int8 activation codec on both sides (delivery and the
  verifier's reply);
- detection: a bf16 stage's delivery corrupted before the codec by Gaussian noise of s x each
  row's std (s = 0.02, 0.05, 0.1, 0.2, 0.4) or scaled by 1.1, at (a) every position, (b) one position
  drawn at random, (c) only positions whose id is not a multiple of 8 (what the old top-k
  commitments at every 8th position never opened); checked against an fp32 recomputation with the
  run's tolerance for that codec (`CommitTolerance.for_codec`). Per corruption: the share of
  positions that fail (a), and the share of `--trials` checks (each with a fresh secret matrix and
  fresh noise) that fail at all (a, b, c). "honest" is the false alarm rate.

With `--sessions N`, also the honest error on N sessions like the demo's (a chat prompt of its
task, a group of sampled rows): real sessions have a longer tail than the 8 prompts above.

Run: decentrl bench commit-sensitivity [--models smollm2-135m-instruct,tiny] [--trials 20]
     [--dims 32] [--sessions 0] [--json PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench import common
from decentrl.model.blocks import positions_from_valid
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.stages import StageModule, StagePlan, build_stage
from decentrl.net.wire import ActivationCodec, decode_tensor, encode_tensor
from decentrl.rollout.generate import left_pad
from decentrl.trust.commit import (
    CommitCheck,
    CommitTolerance,
    check_sketches,
    sketch_matrix,
    take_sketches,
)

TEXTS = ["The quick brown fox jumps over the lazy dog, twice, and then sleeps under the tree.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "What is 37 + 48? Let me think step by step. 37 + 48 = 85. So the answer is 85.",
         "Translate to French: 'I would like a cup of coffee, please, and a croissant.'",
         "Once upon a time in a land far away there lived a king who had three daughters.",
         "import numpy as np\nx = np.arange(10)\nprint(x.sum(), x.mean(), x.std())",
         "Q: What is the capital of France? A: Paris. Q: And of Italy? A: Rome.",
         "Hello! How are you today?"]
TINY_LENGTHS = (40, 17, 33, 26, 45, 12, 30, 22)
NOISES = (0.02, 0.05, 0.1, 0.2, 0.4)
CODECS: tuple[ActivationCodec, ...] = ("bf16", "int8")
PREFILL = 8
EXTRA_PADDING = 3
UNOPENED_EVERY = 8

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden [B, T, H], positions, valid


def stage0(model: LoadedModel, dtype: torch.dtype) -> StageModule:
    plan = StagePlan.even(model.spec.num_layers, 2)
    return build_stage(model.spec, plan, 0, model.tensors, torch.device("cpu"), dtype)


def layout(seqs: list[list[int]], extra: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded token ids, position ids and the valid mask [B, T], `extra` more columns."""
    ids, valid = left_pad(seqs, 0, torch.device("cpu"))
    ids, valid = F.pad(ids, (extra, 0)), F.pad(valid, (extra, 0))
    return ids, positions_from_valid(valid), valid


@torch.no_grad()
def decoded(module: StageModule, seqs: list[list[int]]) -> Batch:
    """What an inference session delivers: a prefill, then one column per step (KV cache)."""
    ids, positions, valid = layout(seqs)
    cache = module.new_cache(*ids.shape)
    outs = [module.body(ids[:, :PREFILL], positions[:, :PREFILL], valid[:, :PREFILL], cache)]
    for t in range(PREFILL, ids.shape[1]):
        outs.append(module.body(ids[:, t:t + 1], positions[:, t:t + 1], valid[:, :t + 1], cache))
    return torch.cat(outs, 1).float(), positions, valid


@torch.no_grad()
def teacher_forced(module: StageModule, seqs: list[list[int]]) -> Batch:
    """A verifier's re-execution: whole rows at once, with more left padding."""
    ids, positions, valid = layout(seqs, EXTRA_PADDING)
    return module.body(ids, positions, valid).float(), positions, valid


def through(codec: ActivationCodec, hidden: torch.Tensor) -> torch.Tensor:
    parts, spec = encode_tensor(hidden, codec, "hidden")
    return decode_tensor(parts, spec).float()


def check(delivered: Batch, recomputed: Batch, matrix: torch.Tensor,
          tolerance: CommitTolerance) -> CommitCheck:
    return check_sketches(take_sketches(*delivered, matrix), matrix, *recomputed, tolerance)


def corruptions(generator: torch.Generator) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each corruption of a delivery [B, T, H], by name."""
    def noise(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda h: h + scale * h.std(-1, keepdim=True) * torch.randn(h.shape,
                                                                           generator=generator)
    return {"honest": lambda h: h, **{f"noise {s}x std": noise(s) for s in NOISES},
            "x 1.1": lambda h: h * 1.1}


def where(kind: str, positions: torch.Tensor, valid: torch.Tensor,
          generator: torch.Generator) -> torch.Tensor:
    """The entries [B, T] a corruption of `kind` touches."""
    if kind == "every":
        return valid
    if kind == "unopened":
        return valid & (positions % UNOPENED_EVERY != 0)
    rows, cols = valid.nonzero(as_tuple=True)
    pick = int(torch.randint(len(rows), (1,), generator=generator))
    one = torch.zeros_like(valid)
    one[rows[pick], cols[pick]] = True
    return one


def measure(model: LoadedModel, seqs: list[list[int]], dims: int, trials: int
            ) -> dict[str, Any]:
    bf16, fp32 = stage0(model, torch.bfloat16), stage0(model, torch.float32)
    delivered = {"bf16": decoded(bf16, seqs), "fp32": decoded(fp32, seqs)}
    recomputed = {"bf16": teacher_forced(bf16, seqs), "fp32": teacher_forced(fp32, seqs)}
    hidden = model.spec.hidden_size
    honest: dict[str, dict[str, float]] = {}
    for codec in CODECS:
        checks = [check((through(codec, delivered[a][0]), *delivered[a][1:]),
                        (through(codec, recomputed[b][0]), *recomputed[b][1:]),
                        sketch_matrix(seed, dims, hidden), CommitTolerance())
                  for a, b in (("bf16", "fp32"), ("fp32", "bf16")) for seed in range(trials)]
        honest[codec] = {"worst": max(c.worst for c in checks),
                         "mean": max(c.mean for c in checks)}
    detection: dict[str, dict[str, dict[str, float]]] = {}
    base, positions, valid = delivered["bf16"]
    for codec in CODECS:
        tolerance = CommitTolerance.for_codec(codec)
        truth = (through(codec, recomputed["fp32"][0]), *recomputed["fp32"][1:])
        table: dict[str, dict[str, float]] = {}
        generator = torch.Generator().manual_seed(0)
        for name, corrupt in corruptions(generator).items():
            figures = {"every_positions": 0.0, "every": 0.0, "single": 0.0, "unopened": 0.0}
            for trial in range(trials):
                matrix = sketch_matrix(1000 + trial, dims, hidden)
                for kind in ("every", "single", "unopened"):
                    touched = where(kind, positions, valid, generator)[..., None]
                    lie = torch.where(touched, corrupt(base), base)
                    result = check((through(codec, lie), positions, valid), truth, matrix,
                                   tolerance)
                    figures[kind] += (result.failed > 0) / trials
                    if kind == "every":
                        figures["every_positions"] += result.failed / result.checked / trials
            table[name] = figures
        detection[codec] = table
    return {"positions": int(valid.sum()), "hidden": hidden, "honest": honest,
            "detection": detection}


@torch.no_grad()
def session_tail(model: LoadedModel, groups: int, dims: int) -> dict[str, float]:
    """Honest error on sessions like the demo's: per group, one problem of the demo's task as a
    chat prompt and `group_size` rows of `max_new_tokens` tokens sampled at T=1 (fp32, seeded),
    decoded in bf16 by stage 0 and recomputed teacher-forced in fp32, both through the bf16
    codec. The exact position error ||h - h'|| / ||h'|| and its estimate by one secret sketch
    per group."""
    from decentrl.demo import demo_config
    from decentrl.model.stages import build_stages
    from decentrl.rollout.chain import LocalChain
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig
    from decentrl.tasks import make_task
    from decentrl.tasks.base import problems, render_prompt

    demo = demo_config("sums")
    rollout, task_config = demo["rollout"], demo["task"]
    task = make_task(task_config["name"], **task_config["options"])
    plan = StagePlan.even(model.spec.num_layers, 2)
    chain = LocalChain(build_stages(model.spec, plan, model.tensors, torch.device("cpu"),
                                    torch.float32))
    bf16, fp32 = stage0(model, torch.bfloat16), stage0(model, torch.float32)
    tokenizer = model.tokenizer
    exact: list[torch.Tensor] = []
    sketched: list[float] = []
    for index, problem in enumerate(problems(task, "train", groups)):
        prompt = render_prompt(task, problem, tokenizer)
        rows = [prompt + list(g.tokens) for g in generate(
            chain, [prompt] * rollout["group_size"], rollout["max_new_tokens"],
            SamplingConfig(temperature=1.0), {tokenizer.eos_token_id},
            tokenizer.pad_token_id, seed=index)]
        hidden, positions, valid = decoded(bf16, rows)
        recomputed, re_positions, re_valid = teacher_forced(fp32, rows)
        hidden, recomputed = through("bf16", hidden), through("bf16", recomputed)
        aligned = recomputed[:, EXTRA_PADDING:]  # the same columns as the delivery
        exact.append(((hidden - aligned).norm(dim=-1) / aligned.norm(dim=-1))[valid])
        matrix = sketch_matrix(5000 + index, dims, model.spec.hidden_size)
        sketched.append(check((hidden, positions, valid), (recomputed, re_positions, re_valid),
                              matrix, CommitTolerance()).worst)
    errors = torch.cat(exact)
    return {"groups": groups, "positions": errors.numel(),
            "exact_p99": float(errors.quantile(0.99)), "exact_worst": float(errors.max()),
            "sketch_worst": max(sketched)}


def model_rows(name: str, model: LoadedModel) -> list[list[int]]:
    if name == "tiny":
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, model.spec.vocab_size, (n,), generator=g).tolist()
                for n in TINY_LENGTHS]
    return [model.tokenizer(text)["input_ids"] for text in TEXTS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench commit-sensitivity",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,tiny",
                        help="comma-separated model names or folders; tiny: a tiny random model")
    parser.add_argument("--trials", type=int, default=20,
                        help="checks per figure, each with its own secret matrix and noise")
    parser.add_argument("--dims", type=int, default=32, help="sketch dims (trust.sketch_dims)")
    parser.add_argument("--sessions", type=int, default=0,
                        help="also measure the honest error on this many demo-like sessions")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.dims < 1:
        parser.error(f"--trials and --dims must be >= 1, got {args.trials}, {args.dims}")
    torch.manual_seed(0)
    results, figures = {}, {}
    for name in args.models.split(","):
        model = load_model(common.bench_model(name))
        result = measure(model, model_rows(name, model), args.dims, args.trials)
        results[name] = result
        common.print_table(
            f"{name} stage 0: honest error ({result['positions']} positions, hidden "
            f"{result['hidden']}, sketch of {args.dims}), bf16 vs fp32 both ways",
            ["codec", "worst", "mean"],
            [[codec, h["worst"], h["mean"]] for codec, h in result["honest"].items()])
        for codec, table in result["detection"].items():
            tolerance = CommitTolerance.for_codec(codec)
            common.print_table(
                f"{name} stage 0, {codec} codec (max error {tolerance.max_error}, mean "
                f"{tolerance.max_mean_error}): share caught",
                ["corruption", "(a) every: positions", "(a) every: checks", "(b) single",
                 "(c) unopened"],
                [[label, f["every_positions"], f["every"], f["single"], f["unopened"]]
                 for label, f in table.items()])
            for label, f in table.items():
                key = label.replace(" ", "_").replace("x_std", "").replace(".", "p")
                for kind, value in f.items():
                    figures[f"{name}_{codec}_{key.strip('_')}_{kind}"] = value
        for codec, h in result["honest"].items():
            figures[f"{name}_{codec}_honest_worst"] = h["worst"]
            figures[f"{name}_{codec}_honest_mean"] = h["mean"]
        if args.sessions:
            tail = session_tail(model, args.sessions, args.dims)
            result["sessions"] = tail
            common.print_table(
                f"{name} stage 0: honest error on {tail['groups']} demo-like sessions "
                f"({tail['positions']} positions), bf16 decoding vs fp32, bf16 codec",
                ["exact p99", "exact worst", "sketch worst"],
                [[tail["exact_p99"], tail["exact_worst"], tail["sketch_worst"]]])
            figures.update({f"{name}_sessions_{k}": v for k, v in tail.items()})
    common.print_figures("commit-sensitivity", figures)
    common.write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
