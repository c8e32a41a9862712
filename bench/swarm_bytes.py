"""Bytes between stages per rollout and step, per codec.

Bytes that cross stage boundaries per rollout and per training step in the swarm, for each
activation codec (fp32, bf16, int8).

What runs, per codec (`--codecs`, each in its own process unless `--in-process`): a client node
and, per stage (`--stages`), one training peer and `--replicas` inference peers, every one its own
SwarmNode (hivemind p2p daemon) with a StagePeer in this process, on loopback with a perfect link
(no sleeps: bytes do not depend on latency). The client plays the coordinator:
- rollouts: `--batch` B completions, `--batch / --group-size` sums prompts x `--group-size` samples,
  one `generate` call (one session) per group as the coordinator's generation threads do, through
  a `RemoteChain`: exactly `--max-new-tokens` T new tokens per row (no stop ids, so every codec
  decodes the same number of tokens whatever it samples);
- one training step on those B completions (advantages +1/-1 within each group, so no group is
  dropped) through `RemoteStageWorker`s driven by the `PipelineTrainer`
  (`--micro-batch` sequences per micro-batch);
- then every inference replica fetches its stage's new version, a compressed update (sync/: the
  run's `[sync]` defaults, a 1 %-density int8 delta), as the replicas follow their training peer.

The figures come from the link emulators (net/link.py), which count every message of every RPC in
both directions on the caller's side: the client's node for rollouts and the training step (the
client calls every stage itself: hidden states go stage -> client -> next stage, so each boundary
is crossed twice, and token ids, positions and masks travel too), the replicas' nodes for the
weight downloads. Bytes are whole hivemind messages (protobuf framing and metadata included); DHT
traffic is not counted. A training step sends the batch tensors (token ids, masks, behaviour
log-probs, advantages) to every stage in full precision whatever the codec, and the weight updates
do not depend on the codec, so only part of each figure scales with it.

Run: decentrl bench swarm-bytes [--model smollm2-135m-instruct|tiny|PATH] [--batch 8]
     [--group-size 4] [--max-new-tokens 16] [--micro-batch 8] [--codecs fp32,bf16,int8]
     [--replicas 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.lineage import LineageSigner
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.session import new_session
from decentrl.net.wire import TensorLimits
from decentrl.stage.peer import StagePeer

CODECS = ("fp32", "bf16", "int8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = common.bench_parser("swarm-bytes", __doc__, "measurement")
    parser.set_defaults(batch=8, threads=1)
    for action in parser._actions:  # shared options, with this bench's meaning
        if action.dest == "batch":
            action.help = "completions generated and trained on"
        elif action.dest in ("steps", "warmup", "profile"):
            action.help = "unused by this bench (bytes do not vary between repeats)"
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--replicas", type=int, default=1, help="inference peers per stage")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated")
    args = parser.parse_args(argv)
    args.variants = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not args.variants or any(c not in CODECS for c in args.variants):
        parser.error(f"--codecs must name some of {', '.join(CODECS)}")
    if args.group_size < 2 or args.batch % args.group_size:
        parser.error("--group-size must be >= 2 and divide --batch")
    if min(args.stages, args.replicas, args.max_new_tokens, args.micro_batch) < 1:
        parser.error("--stages, --replicas, --max-new-tokens and --micro-batch must be >= 1")
    return args


def start_peer(config: RunConfig, stage: int, role: str, addresses: list[str], owner: str,
               checkpoint_dir: Path, name: str) -> StagePeer:
    """A peer of the run `owner` (the client, playing the coordinator) owns."""
    node = SwarmNode.start(name, addresses, LinkProfile(), TensorLimits())
    try:
        peer = StagePeer(config, stage, role, node, owner,  # type: ignore[arg-type]
                         checkpoint_dir, name)
        peer.start()
    except BaseException:
        node.shutdown()
        raise
    return peer


def link_bytes(node: SwarmNode) -> dict[str, int]:
    """Bytes and messages each way over every link of `node`, summed."""
    assert node.links is not None
    totals = {"bytes_out": 0, "bytes_in": 0, "messages_out": 0, "messages_in": 0}
    for stats in node.links.stats().values():
        for key in totals:
            totals[key] += getattr(stats, key)
    return totals


def per_peer(node: SwarmNode, stage_of: dict[str, str]) -> dict[str, dict[str, int]]:
    assert node.links is not None
    return {stage_of.get(peer, peer[-8:]): {"bytes_out": s.bytes_out, "bytes_in": s.bytes_in,
                                            "messages": s.messages_out + s.messages_in}
            for peer, s in node.links.stats().items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def run_variant(codec: str, args: argparse.Namespace) -> dict[str, Any]:
    from decentrl.client.sessions import RemoteChain
    from decentrl.client.training import RemoteStageWorker
    from decentrl.learn.batch import build_batch
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.learn.trainer import PipelineTrainer
    from decentrl.net.directory import Directory
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import sampling_config
    from decentrl.rollout.types import Rollout
    from decentrl.tasks import make_task, problems, render_prompt

    with tempfile.TemporaryDirectory(prefix="decentrl-bench-") as folder:
        loaded, _, _ = common.variant_setup(args)  # the peers pick their own device and dtype
        loaded.tensors.clear()  # the peers read their own stages
        tokenizer = loaded.tokenizer
        config = parse_config({
            "name": f"bytes-{codec}", "model": str(loaded.path), "num_stages": args.stages,
            "seed": args.seed,
            "host": {"run_dir": str(Path(folder) / "runs"), "device": args.device,
                     "dtype": args.dtype},
            "rollout": {"group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
            "train": {"micro_batch_size": args.micro_batch},
            # Replicas look for new weights every announce_every_s / 2.
            # Relayed: every boundary's bytes cross the client's links, where they are counted
            # (peer to peer they leave the client: bench/coordinator_bytes.py).
            "swarm": {"activation_codec": codec, "announce_every_s": 1.0,
                      "request_timeout_s": 300.0, "data_plane": "coordinator"},
        })
        client = SwarmNode.start("client", [], LinkProfile(), TensorLimits())
        peers: list[StagePeer] = []
        try:
            addresses = client.addresses()
            for stage in range(args.stages):
                peers.append(start_peer(config, stage, "training", addresses, client.peer_id,
                                        Path(folder) / "checkpoints", f"train{stage}"))
                for replica in range(args.replicas):
                    peers.append(start_peer(config, stage, "inference", addresses,
                                            client.peer_id, Path(folder) / "checkpoints",
                                            f"infer{stage}.{replica}"))
            stage_of = {p.node.peer_id: f"{p.name} (stage {p.index})" for p in peers}
            directory = Directory(client, config.name, config.num_stages, config.swarm)
            directory.refresh()
            chain = RemoteChain(client, directory, config.swarm, config.trust, loaded.spec)

            # ---- rollouts: one session per group, as the coordinator generates them
            task = make_task("sums")
            prompts = [render_prompt(task, p, tokenizer)
                       for p in problems(task, "train", args.batch // args.group_size)]
            rollouts: list[Rollout] = []
            before = link_bytes(client)
            started = time.perf_counter()
            for index, prompt in enumerate(prompts):
                out = generate(chain, [prompt] * args.group_size, args.max_new_tokens,
                               sampling_config(config.rollout), set(), tokenizer.pad_token_id,
                               args.seed * 1_000_003 + index)
                rollouts += [Rollout(prompt_tokens=prompt, completion_tokens=g.tokens,
                                     behaviour_logprobs=g.logprobs, finished=g.finished)
                             for g in out]
            generation_s = time.perf_counter() - started
            rollout = delta(link_bytes(client), before)
            rollout_links = per_peer(client, stage_of)
            new_tokens = sum(len(r.completion_tokens) for r in rollouts)

            # ---- one training step on them
            advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))]
            batch = build_batch(rollouts, advantages, [0] * len(rollouts),
                                tokenizer.pad_token_id)
            trainers = {p.node.peer_id for p in peers if p.role == "training"}
            lineage = LineageSigner(client, config, new_session())  # closed with the client's node
            workers = [RemoteStageWorker(client, directory, stage, config.num_stages,
                                         config.swarm, trainers.__contains__, lineage)
                       for stage in range(config.num_stages)]
            for worker in workers:
                worker.connect()
            trainer = PipelineTrainer(workers, config.train,
                                      loss_config_from(config.train, args.max_new_tokens),
                                      sampling_config(config.rollout), torch.device("cpu"))
            replicas = [p for p in peers if p.role == "inference"]
            replicas_before = [link_bytes(p.node) for p in replicas]
            before = link_bytes(client)
            started = time.perf_counter()
            trainer.train_step(batch)
            train_s = time.perf_counter() - started
            train = delta(link_bytes(client), before)

            # ---- the replicas follow the new weights
            deadline = time.monotonic() + 120
            while any(p.version != trainer.version for p in replicas):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replicas did not load version {trainer.version}")
                time.sleep(0.2)
            weights = [delta(link_bytes(p.node), b) for p, b in zip(replicas, replicas_before)]
            weights_total = {key: sum(w[key] for w in weights) for key in weights[0]}
            return {
                "codec": codec, "variant": codec, "machine": common.machine(torch.device("cpu")),
                "rollouts": len(rollouts), "new_tokens": new_tokens,
                "train_sequences": batch.num_sequences,
                "train_target_tokens": batch.num_target_tokens,
                "prompt_lengths": [len(p) for p in prompts],
                "hidden_size": loaded.spec.hidden_size, "generation_s": generation_s,
                "train_s": train_s, "rollout": rollout, "train": train,
                "weights": weights_total, "replicas": len(replicas),
                "links_after_rollouts": rollout_links,
            }
        finally:
            for peer in peers:
                try:
                    peer.stop()
                finally:
                    peer.node.shutdown()
            client.shutdown()


def total(counts: dict[str, int]) -> int:
    return counts["bytes_out"] + counts["bytes_in"]


def main(argv: list[str] | None = None) -> None:
    common.run_variants(__spec__.name, argv, parse_args(argv), run_variant, report)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base = next((r for r in results if r["codec"] == "fp32"), None)
    rows = []
    figures: dict[str, float] = {}
    for r in results:
        per_rollout = total(r["rollout"]) / r["rollouts"]
        per_step = float(total(r["train"]))
        weights = float(total(r["weights"]))
        ratio_rollout = ratio_step = "-"
        if base is not None:
            ratio_rollout = per_rollout / (total(base["rollout"]) / base["rollouts"])
            ratio_step = per_step / total(base["train"])
            figures[f"{r['codec']}_rollout_ratio"] = ratio_rollout
            figures[f"{r['codec']}_train_ratio"] = ratio_step
        rows.append([r["codec"], per_rollout, total(r["rollout"]) / r["new_tokens"], ratio_rollout,
                     per_step, per_step / r["train_sequences"], ratio_step, weights])
        figures[f"{r['codec']}_bytes_per_rollout"] = per_rollout
        figures[f"{r['codec']}_bytes_per_train_step"] = per_step
        figures[f"{r['codec']}_replica_weight_bytes_per_step"] = weights
    first = results[0]
    lengths = first["prompt_lengths"]
    caption = (f"{args.stages} stages, hidden size {first['hidden_size']}; rollouts: "
               f"{first['rollouts']} completions ({args.batch // args.group_size} prompts of "
               f"{min(lengths)}-{max(lengths)} tokens x {args.group_size} samples, one session per "
               f"group), exactly {args.max_new_tokens} new tokens each; train step: "
               f"{first['train_sequences']} sequences, micro-batches of {args.micro_batch}; bytes "
               f"are whole messages both ways on the client's links; replica weights: what all "
               f"{first['replicas']} replica(s) downloaded after the step, on their own "
               f"links\n{first['machine']}")
    common.print_table("swarm bytes across stage boundaries, by activation codec",
                       ["codec", "bytes/rollout", "bytes/new token", "rollout vs fp32",
                        "bytes/train step", "bytes/trained seq", "train vs fp32",
                        "replica weights/step"], rows, caption)
    common.print_figures("swarm_bytes", figures)
    common.write_json(args.json, {"bench": "swarm-bytes", "args": vars(args), "results": results,
                                  "figures": figures})


if __name__ == "__main__":
    main()
