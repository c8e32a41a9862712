"""Spot checks of claimed experts: how far honest bf16 replicas' routing records fall from an
fp32 re-execution's routers, and how far forged ones do (trust.routing_tolerance).

A mixture of experts' replica records the experts each token went to, and the learner replays
them (train.routing_replay): a replica that lies about them steers training through experts the
model did not choose. A spot check re-executes the stage and scores every claimed token by its
routing gap (model/moe.py `routing_gaps`): the router's k-th best logit minus the weakest claimed
expert's, in nats, 0 for the router's own top-k. An honest replica in another dtype picks the
other side of a near tie now and then; its gap is then the tie's width.

Per family, router scale (`--inits`: the std of the tiny model's weights, routers included; the
router logits' spread grows with it) and seed:
  1. a bf16 copy of the model samples `--batch` completions of `--length` tokens of random
     prompts, recording its routing: the honest claims;
  2. an fp32 copy re-executes prompt and completion teacher-forced, stage by stage, under a
     RouterProbe, and scores the honest claims and two forgeries of every claimed token, each
     in one random sparse layer: `random` puts an expert the router did not choose in place of
     a claimed one; `next best` puts the router's (k+1)-th best in place of its k-th (the
     smallest lie there is).
Columns: the router logits' std; the bf16 sampler's mean relative error ||h_bf16 - h_fp32|| /
||h_fp32|| at the last stage's output, teacher-forced (the hidden-state spot check, trust/
commit.py, fails a mean over 0.03: beyond that an honest bf16 replica fails it anyway); the honest gaps' 99.9th percentile and maximum and the share
over the tolerance (`--tolerance`; a check fails a replica only beyond trust.max_mismatch_fraction
of its tokens); per forgery the median gap and the share of forged tokens caught (gap over the
tolerance).

Run: python -m bench.expert_claims [--families qwen3_moe,mixtral] [--inits 0.05,0.1,0.2]
     [--seeds 2] [--batch 16] [--length 24] [--prompt 8] [--layers 4] [--experts 8]
     [--top-k 2] [--hidden 64] [--stages 2] [--tolerance 0.5] [--threads 2] [--json PATH]
CPU; well under a minute on two cores."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from bench import common
from bench.moe_routing_replay import add_tiny_moe_arguments, tiny_moe
from decentrl.model.loading import LoadedModel, load_model
from decentrl.model.moe import FREE_ROUTE, routing_gaps
from decentrl.model.router_probe import RouterProbe
from decentrl.model.stages import StageModule, StagePlan, build_stages
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.generate import generate
from decentrl.rollout.sampling import SamplingConfig

CLAIMS = ("honest", "random", "next best")


def honest_claims(sampler: list[StageModule], seed: int, args: argparse.Namespace
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B, P + L], claimed experts [B, P + L, sparse layers, top_k]) of the bf16
    sampler's completions: each completion token's recorded experts at its column, FREE_ROUTE
    at the prompt's (not recorded) and at the last token (never fed)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = sampler[0].spec.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=generator)
    rows = generate(LocalChain(sampler), prompts.tolist(), args.length, SamplingConfig(), set(),
                    0, seed=seed, record_routing=True)
    ids = torch.cat([prompts, torch.tensor([row.tokens for row in rows])], dim=1)
    first = rows[0].routing
    assert first is not None
    claims = torch.full((*ids.shape, *first.shape[1:]), FREE_ROUTE, dtype=torch.long)
    for row, generated in enumerate(rows):
        assert generated.routing is not None
        claims[row, args.prompt:] = generated.routing.long()
    return ids, claims


def reexecute(stages: list[StageModule], ids: torch.Tensor
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The router logits (fp32) of every sparse layer over the teacher-forced sequence, each
    [B, T, experts], in layer order; and the last stage's hidden states [B, T, H]."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    x, logits = ids, []
    with torch.inference_mode():
        for stage in stages:
            with RouterProbe(stage) as probe:
                x = stage.body(x, positions, valid)
            logits += probe.router_logits
    return logits, x.float()


def forged(claims: torch.Tensor, logits: list[torch.Tensor], kind: str,
           generator: torch.Generator) -> torch.Tensor:
    """`claims` with one random sparse layer of every claimed token lied about (`kind`)."""
    lies = claims.clone()
    batch, length, layers, top_k = claims.shape
    experts = logits[0].shape[-1]
    for row, column in (claims[:, :, 0, 0] != FREE_ROUTE).nonzero().tolist():
        layer = int(torch.randint(layers, (1,), generator=generator))
        ranked = logits[layer][row, column].argsort(descending=True)
        if kind == "next best":
            # The router's k-th best out, its (k+1)-th in.
            lies[row, column, layer] = torch.cat([ranked[:top_k - 1], ranked[top_k:top_k + 1]])
            continue
        outside = [e for e in range(experts) if e not in ranked[:top_k].tolist()]
        slot = int(torch.randint(top_k, (1,), generator=generator))
        pick = int(torch.randint(len(outside), (1,), generator=generator))
        lies[row, column, layer, slot] = outside[pick]
    return lies


def token_gaps(claims: torch.Tensor, logits: list[torch.Tensor]) -> torch.Tensor:
    """Every claimed token's routing gap, the largest over its sparse layers."""
    claimed = claims[:, :, 0, 0] != FREE_ROUTE
    per_layer = [routing_gaps(layer[claimed], claims[:, :, index][claimed])
                 for index, layer in enumerate(logits)]
    return torch.stack(per_layer).amax(0)


def run(model: LoadedModel, seed: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """{claim: gaps}, the router logits' std ("std") and the bf16 hidden states' mean relative
    error ("hidden_error") of one model and seed."""
    plan = StagePlan.even(model.spec.num_layers, args.stages)
    sampler = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.bfloat16)
    verifier = build_stages(model.spec, plan, model.tensors, torch.device("cpu"), torch.float32)
    torch.manual_seed(seed)
    ids, claims = honest_claims(sampler, seed, args)
    logits, hidden = reexecute(verifier, ids)
    low_hidden = reexecute(sampler, ids)[1]
    generator = torch.Generator().manual_seed(seed)
    error = (low_hidden - hidden).norm(dim=-1) / hidden.norm(dim=-1)
    result = {"std": torch.stack([layer.std() for layer in logits]).mean()[None],
              "hidden_error": error.mean()[None]}
    for kind in CLAIMS:
        lies = claims if kind == "honest" else forged(claims, logits, kind, generator)
        result[kind] = token_gaps(lies, logits)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench expert-claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="qwen3_moe,mixtral")
    parser.add_argument("--inits", default="0.05,0.1,0.2",
                        help="std of the tiny models' weights, routers included")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=24, help="sampled tokens per sequence")
    parser.add_argument("--prompt", type=int, default=8, help="tokens per random prompt")
    add_tiny_moe_arguments(parser)
    parser.add_argument("--tolerance", type=float, default=0.5,
                        help="trust.routing_tolerance to score against (nats)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    inits = [float(value) for value in args.inits.split(",")]
    if args.seeds < 1 or args.batch < 1 or args.length < 2 or args.prompt < 1:
        parser.error("--seeds >= 1, --batch >= 1, --length >= 2 and --prompt >= 1 are needed")
    if not 1 <= args.top_k < args.experts:
        parser.error("--top-k must lie in [1, --experts): a forgery needs an expert left out")
    if not 1 <= args.stages <= args.layers:
        parser.error(f"--stages must lie in [1, --layers={args.layers}]")
    torch.set_num_threads(args.threads)
    table, figures = [], {}
    for family in args.families.split(","):
        for init in inits:
            args.init = init
            runs = []
            for seed in range(args.seeds):
                with tempfile.TemporaryDirectory() as folder:
                    model = load_model(str(tiny_moe(family, Path(folder) / family, seed, args)))
                runs.append(run(model, seed, args))
            gaps = {kind: torch.cat([r[kind] for r in runs]) for kind in CLAIMS}
            honest = gaps["honest"]
            row = {"std": statistics.fmean(float(r["std"]) for r in runs),
                   "hidden_error": statistics.fmean(float(r["hidden_error"]) for r in runs),
                   "honest_p999": float(honest.quantile(0.999)),
                   "honest_max": float(honest.max()),
                   "honest_over": float((honest > args.tolerance).float().mean())}
            for kind in CLAIMS[1:]:
                name = kind.replace(" ", "_")
                row[f"{name}_median"] = float(gaps[kind].median())
                row[f"{name}_caught"] = float((gaps[kind] > args.tolerance).float().mean())
            table.append([family, init, *row.values()])
            figures.update({f"{family}_{init:g}_{key}": value for key, value in row.items()})
    common.print_table(
        f"routing gaps of claimed experts, bf16 replica vs fp32 re-execution ({args.seeds} "
        f"seeds x {args.batch} x {args.length} tokens, {args.layers} layers in {args.stages} "
        f"stages, {args.experts} experts, top-{args.top_k}, tolerance {args.tolerance:g} nats)",
        ["family", "init", "router logit std", "bf16 hidden error", "honest p99.9", "honest max", "honest over",
         "random median", "random caught", "next-best median", "next-best caught"], table,
        caption="gap: the router's k-th best logit minus the weakest claimed expert's (nats); "
                "over / caught: share of tokens whose gap exceeds the tolerance.")
    common.print_figures("expert_claims", figures)
    common.write_json(args.json, {"figures": figures, "rows": table})


if __name__ == "__main__":
    main()
