"""Bytes in and out of the coordinator per generated and trained token, by data plane and width.

What goes through the coordinator's link when it generates and trains, with activations relayed
through it
(`swarm.data_plane = "coordinator"`, before issue #36) and pushed from stage to stage
(`"peer_to_peer"`, after), at each stage count, for the demo's model and for tiny random models
of several hidden widths (the figure must not grow with the width after).

What runs, per variant (model x stages x plane, each in its own process unless `--in-process`):
a client node playing the coordinator and, per stage, `--replicas` inference peers (default 2:
one serves, one re-executes a spot-check), each a SwarmNode with a StagePeer in this process, on
loopback with a perfect link (bytes do not depend on latency). The client generates `--groups`
groups of `--group-size` samples of sums prompts, one session per group as the coordinator's
generation threads do, exactly `--max-new-tokens` new tokens per row (no stop ids), then
spot-checks the first group as the coordinator's gate does (trust/verify.py: re-executed on the
other replicas; after, the serving replicas reveal what they sent, trust/reveal.py), and with
`--train` (the default) runs one training step on the groups through a training peer per stage
(`--micro-batch 4` sequences per micro-batch; after, micro-batches pushed down the chain of
training peers, client/training_push.py). Bytes come
from the client's link emulators, which count every message of every RPC it makes, both ways
(hivemind messages, framing and metadata included; DHT traffic not counted): in both planes
the coordinator only calls, it serves nothing.

Figures: generation bytes per generated token, training bytes per trained (completion) token,
and a spot-check's bytes per checked group and amortised per generated token at the run's
default `trust.verify_fraction`.

Run: decentrl bench coordinator-bytes [--model smollm2-135m-instruct] [--stage-counts 2,4,8]
     [--widths 64,512,2048] [--planes coordinator,peer_to_peer] [--groups 2] [--group-size 4]
     [--max-new-tokens 16] [--replicas 2] [--codec bf16] [--no-train] [--micro-batch 4]
     [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.swarm_bytes import delta, link_bytes, start_peer, total

PLANES = ("coordinator", "peer_to_peer")
TARGET_STAGES, TARGET_RATIO = 4, 20.0  # issue #36: at least 20x less at 4 stages, demo model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("coordinator-bytes", __doc__, "measurement")
    parser.add_argument("--stage-counts", default="2,4,8", help="comma-separated stage counts")
    parser.add_argument("--widths", default="64,512,2048",
                        help="hidden widths of tiny random models (8 layers), comma-separated; "
                             "'' for none")
    parser.add_argument("--planes", default=",".join(PLANES), help="comma-separated data planes")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2,
                        help="inference peers per stage (2: a spot-check has a re-executor)")
    parser.add_argument("--codec", default="bf16", choices=("fp32", "bf16", "int8"))
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="also one training step on the groups, through a training peer "
                             "per stage (--micro-batch sequences per micro-batch)")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        stage_counts = [int(s) for s in args.stage_counts.split(",") if s.strip()]
        widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
        parser.error("--stage-counts and --widths must be comma-separated integers")
    planes = [p.strip() for p in args.planes.split(",") if p.strip()]
    if not planes or any(p not in PLANES for p in planes):
        parser.error(f"--planes must name some of {', '.join(PLANES)}")
    if not stage_counts or min(stage_counts) < 2 or any(w < 8 for w in widths):
        parser.error("--stage-counts need >= 2 stages, --widths >= 8")
    if min(args.groups, args.group_size, args.max_new_tokens, args.replicas) < 1:
        parser.error("--groups, --group-size, --max-new-tokens and --replicas must be >= 1")
    models = [args.model, *(f"tiny-{width}" for width in widths)]
    args.variants = [f"{model}|{stages}|{plane}" for model in models
                     for stages in stage_counts for plane in planes]
    return args


def model_folder(name: str, folder: Path) -> str:
    """`tiny-W`: a tiny random model of hidden width W and 8 layers (any stage count up to 8
    splits it); any other name as `--model` takes it."""
    if name.startswith("tiny-"):
        from decentrl.model.tiny import make_tiny_model

        width = int(name.removeprefix("tiny-"))
        return str(make_tiny_model(folder / name, num_layers=8, hidden_size=width))
    return common.bench_model(name)


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from decentrl.client.sessions import RemoteChain
    from decentrl.config import parse_config
    from decentrl.model.loading import load_model
    from decentrl.net.directory import Directory
    from decentrl.net.link import LinkProfile
    from decentrl.net.node import SwarmNode
    from decentrl.net.wire import TensorLimits
    from decentrl.rollout.generate import generate, rollout_group
    from decentrl.rollout.sampling import sampling_config
    from decentrl.tasks import make_task, problems, render_prompt
    from decentrl.trust.verify import Verifier

    name, stages_text, plane = variant.split("|")
    stages = int(stages_text)
    common.quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as folder:
        path = model_folder(name, Path(folder))
        loaded = load_model(path)
        loaded.tensors.clear()  # the peers read their own stages
        tokenizer = loaded.tokenizer
        config = parse_config({
            "name": f"cbytes-{stages}-{plane}", "model": path, "num_stages": stages,
            "seed": args.seed,
            "host": {"run_dir": str(Path(folder) / "runs"), "device": args.device,
                     "dtype": args.dtype},
            "rollout": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
            "train": {"micro_batch_size": args.micro_batch},
            # Announcements rarely (records live 5x this: the DHT keeps them 120 s at most).
            "swarm": {"activation_codec": args.codec, "data_plane": plane,
                      "announce_every_s": 20.0, "request_timeout_s": 300.0},
        })
        client = SwarmNode.start("client", [], LinkProfile(), TensorLimits())
        peers, trainers = [], []
        try:
            trainers = []
            for stage in range(stages):
                if args.train:
                    trainers.append(start_peer(config, stage, "training", client.addresses(),
                                               client.peer_id, Path(folder) / "checkpoints",
                                               f"train{stage}"))
                for replica in range(args.replicas):
                    peers.append(start_peer(config, stage, "inference", client.addresses(),
                                            client.peer_id, Path(folder) / "checkpoints",
                                            f"infer{stage}.{replica}"))
            directory = Directory(client, config.name, stages, config.swarm)
            directory.refresh()
            chain = RemoteChain(client, directory, config.swarm, config.trust, loaded.spec)
            task = make_task("sums")
            prompts = [render_prompt(task, p, tokenizer)
                       for p in problems(task, "train", args.groups)]
            before = link_bytes(client)
            groups, sessions = [], []
            for index, prompt in enumerate(prompts):
                seed = args.seed * 1_000_003 + index
                out = generate(chain, [prompt] * args.group_size, args.max_new_tokens,
                               sampling_config(config.rollout), set(), tokenizer.pad_token_id,
                               seed, on_session=sessions.append)
                groups.append(rollout_group(f"sums/{index}", "sums", index, prompt, out, seed))
            generation = delta(link_bytes(client), before)
            new_tokens = sum(len(r.completion_tokens) for g in groups for r in g.rollouts)
            check: dict[str, int] = {}
            outcome = "-"
            if args.replicas >= 2:
                verifier = Verifier(client, directory, config, loaded.spec.hidden_size,
                                    tokenizer.pad_token_id)
                panel = verifier.panel(sessions[0].provenance)
                before = link_bytes(client)
                verdict = verifier.verify(groups[0], sessions[0].provenance, panel) \
                    if panel is not None else None
                check = delta(link_bytes(client), before)
                outcome = verdict.outcome if verdict is not None else "no panel"
            trained = train_bytes(client, directory, config, groups, tokenizer.pad_token_id,
                                  trainers) if args.train else None
            return {"variant": variant, "model": name, "stages": stages, "plane": plane,
                    "train": trained,
                    "hidden_size": loaded.spec.hidden_size, "new_tokens": new_tokens,
                    "generation": generation, "check": check, "check_outcome": outcome,
                    "group_tokens": sum(len(r.completion_tokens) for r in groups[0].rollouts),
                    "verify_fraction": config.trust.verify_fraction,
                    "failovers": chain.failovers}
        finally:
            for peer in [*peers, *trainers]:
                try:
                    peer.stop()
                finally:
                    peer.node.shutdown()
            client.shutdown()


def train_bytes(client: Any, directory: Any, config: Any, groups: list[Any], pad_id: int,
                trainers: list[Any]) -> dict[str, int]:
    """The coordinator's bytes for one training step on `groups` (advantages +1/-1 in each,
    so no row is dropped), through the stages' training peers, and the tokens it trained."""
    import torch

    from decentrl.client.training import RemoteStageWorker
    from decentrl.client.training_push import PushedTraining
    from decentrl.coordinator.lineage import LineageSigner
    from decentrl.learn.batch import build_batch
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.learn.trainer import PipelineTrainer
    from decentrl.net.session import new_session
    from decentrl.rollout.sampling import sampling_config

    rollouts = [r for g in groups for r in g.rollouts]
    batch = build_batch(rollouts, [1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))],
                        [0] * len(rollouts), pad_id)
    admitted = {p.node.peer_id for p in trainers}.__contains__
    lineage = LineageSigner(client, config, new_session())  # closed with the client's node
    workers = [RemoteStageWorker(client, directory, stage, config.num_stages, config.swarm,
                                 admitted, lineage) for stage in range(config.num_stages)]
    deadline = time.monotonic() + 60  # until every training peer's announcement is found
    while True:
        directory.refresh()
        if all(directory.training_peer(s, admitted) for s in range(config.num_stages)) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for worker in workers:
        worker.connect()
    chain = PushedTraining(client, workers, config.swarm, config.name, "") \
        if config.swarm.data_plane == "peer_to_peer" else None
    trainer = PipelineTrainer(workers, config.train,
                              loss_config_from(config.train, config.rollout.max_new_tokens),
                              sampling_config(config.rollout), torch.device("cpu"), chain=chain)
    before = link_bytes(client)
    trainer.train_step(batch)
    return {"bytes": total(delta(link_bytes(client), before)),
            "tokens": int(batch.num_target_tokens)}


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    by_key = {(r["model"], r["stages"], r["plane"]): r for r in results}
    rows, figures = [], {}
    for r in results:
        per_token = total(r["generation"]) / r["new_tokens"]
        check = total(r["check"]) if r["check"] else None
        amortised = check * r["verify_fraction"] / r["group_tokens"] if check else None
        relayed = by_key.get((r["model"], r["stages"], "coordinator"))
        ratio = (total(relayed["generation"]) / relayed["new_tokens"]) / per_token \
            if relayed is not None and r["plane"] != "coordinator" else None
        trained = r.get("train")
        per_trained = trained["bytes"] / trained["tokens"] if trained else None
        relayed_trained = relayed.get("train") if relayed is not None else None
        train_ratio = (relayed_trained["bytes"] / relayed_trained["tokens"]) / per_trained \
            if per_trained and relayed_trained and r["plane"] != "coordinator" else None
        rows.append([r["model"], r["hidden_size"], r["stages"], r["plane"], per_token,
                     ratio if ratio is not None else "-",
                     per_trained if per_trained is not None else "-",
                     train_ratio if train_ratio is not None else "-", check if check else "-",
                     amortised if amortised is not None else "-", r["check_outcome"]])
        key = f"{r['model']}_{r['stages']}stages_{r['plane']}".replace("-", "_")
        figures[f"{key}_bytes_per_token"] = per_token
        if ratio is not None:
            figures[f"{key}_reduction"] = ratio
        if check:
            figures[f"{key}_check_bytes"] = float(check)
        if per_trained is not None:
            figures[f"{key}_bytes_per_trained_token"] = per_trained
        if train_ratio is not None:
            figures[f"{key}_train_reduction"] = train_ratio
    common.print_table(
        "coordinator bytes per generated token",
        ["model", "hidden", "stages", "data plane", "generation B/token", "x less than relayed",
         "training B/trained token", "x less", "one spot-check B",
         "checks B/token (amortised)", "check"], rows,
        f"activations {args.codec}; {args.groups} groups x {args.group_size} samples of sums "
        f"prompts, {args.max_new_tokens} new tokens each, one session per group; bytes are "
        f"whole messages both ways on the coordinator's links; a spot-check re-executes the "
        f"first group on the other replica of each stage (and, peer to peer, has the serving "
        f"replicas reveal what they sent); amortised at trust.verify_fraction "
        f"{results[0]['verify_fraction']}")
    target = by_key.get((args.model, TARGET_STAGES, "peer_to_peer"))
    if target is not None and f"{args.model}_{TARGET_STAGES}stages_peer_to_peer_reduction".replace(
            "-", "_") in figures:
        reduction = figures[f"{args.model}_{TARGET_STAGES}stages_peer_to_peer_reduction".replace(
            "-", "_")]
        print(f"{args.model} at {TARGET_STAGES} stages: {reduction:.1f}x less per generated "
              f"token; target >= {TARGET_RATIO:.0f}x "
              + ("reached" if reduction >= TARGET_RATIO else "not reached"))
    common.print_figures("coordinator_bytes", figures)
    common.write_json(args.json, {"bench": "coordinator-bytes", "args": vars(args),
                                  "results": results, "figures": figures})


if __name__ == "__main__":
    main()
