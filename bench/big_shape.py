"""Big shape: an 8B-class model that no peer could hold, served and LoRA-trained by 8 peers.

`decentrl bench big-shape` writes a model of Llama-3-8B's shape (32 layers, hidden 4096, 32
query and 8 key-value heads, MLP 14336, vocabulary 128256, untied head) with random bf16 weights
once, as a sharded Hugging Face folder (a shard a layer, the embedding and the head apart; 16 GB,
kept under `--folder`, by default the decentrl cache). Then `--stages 8` peer processes, each a
`decentrl join --role both` (it trains its stage's LoRA adapters and serves generation from the
same frozen base, held once), each started inside a memory cgroup of `--limit-mb` MiB
(`host.memory_limit_mb`, launch/memory_limit.py) that it cannot exceed: past it the kernel
kills it. Each reads only its own stage's tensors from the shards. The bench process is the
coordinator: it holds no weights, generates through the chain of peers (activations pushed from
peer to peer, `--rtt-ms` on every link) and runs LoRA training steps through the 8 training
peers (micro-batches pushed down the chain, gradients back up).

What it prints: per process, the layers it holds, its peak memory (the cgroup's count, page
cache included, and its resident peak, VmHWM, its p2p daemon's included) against its limit and
against the whole model; generated tokens per second for `--prompts` rows of `--prompt-tokens`
random token ids, `--max-new-tokens` each; a LoRA training step's time (`--steps`, the first one
apart: it pays the optimizer's and the adapters' first touch). These are figures of what this
machine can do with the shape, not a learning result: the weights are random.

`--limit-mb A,B,...` gives each stage's peer its own cap (train0 first), as consumer machines
differ; `--plan-from-offers` has the peers offer their caps and measured speeds and the stages
planned from those offers (coordinator/planning.py) instead of an even plan, which a peer
with a small cap may not survive (its cgroup kills it while it loads: the bench says so).

    decentrl bench big-shape [--folder DIR] [--stages 8] [--limit-mb 4096] [--threads 1]
        [--rtt-ms 100] [--prompts 2] [--prompt-tokens 16] [--max-new-tokens 8] [--steps 2]
        [--lora-rank 8] [--layers 32] [--plan-from-offers] [--json PATH]

`--layers 4 --hidden 256 --vocab 1024` makes a small model of the same family for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import common

GIB = 1024**3
LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
             "vocab": 128256, "layers": 32}
MARKER = "decentrl-random-model.json"  # written last: a folder without it is incomplete


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="decentrl bench big-shape", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="where the random model is written once "
                        "(default: the decentrl cache)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--limit-mb", default="4096",
                        help="each peer's memory cap: one for all, or one per stage's peer "
                             "(comma-separated, train0 first)")
    parser.add_argument("--plan-from-offers", action="store_true",
                        help="plan the stages from the peers' offers (their caps and measured "
                             "speeds) instead of an even plan")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    parser.add_argument("--rtt-ms", type=float, default=100.0, help="every link's round trip")
    parser.add_argument("--prompts", type=int, default=2, help="rows generated at once")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="LoRA training steps")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["layers"])
    parser.add_argument("--hidden", type=int, default=LLAMA3_8B["hidden"])
    parser.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    try:
        limits = [int(limit) for limit in args.limit_mb.split(",")]
    except ValueError:
        parser.error(f"--limit-mb takes MiB, one or one a stage: {args.limit_mb!r}")
    if len(limits) not in (1, args.stages):
        parser.error(f"--limit-mb gives {len(limits)} caps for {args.stages} stages")
    args.limits_mb = limits * args.stages if len(limits) == 1 else limits
    if min(args.stages, *args.limits_mb, args.threads, args.prompts, args.prompt_tokens,
           args.max_new_tokens, args.steps, args.lora_rank, args.layers) < 1 \
            or args.stages > args.layers or args.rtt_ms < 0:
        parser.error("every count must be >= 1, --stages at most --layers, --rtt-ms >= 0")
    return args


def shape_config(args: argparse.Namespace) -> dict[str, Any]:
    """config.json of the model: Llama-3-8B's, or a scaled-down one of the same family."""
    scale = args.hidden / LLAMA3_8B["hidden"]
    heads = max(1, round(LLAMA3_8B["heads"] * scale))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": args.hidden, "intermediate_size": int(LLAMA3_8B["intermediate"] * scale),
        "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4), "head_dim": args.hidden // heads,
        "vocab_size": args.vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def layer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    return {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,)}


def write_random_model(folder: Path, config: dict[str, Any], seed: int) -> float:
    """The model in `folder` (written unless a complete one of this config is there); returns
    the seconds spent writing (0 if it was there)."""
    from safetensors.torch import save_file

    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == {"config": config, "seed": seed}:
        return 0.0
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    generator = torch.Generator().manual_seed(seed)
    layers = config["num_hidden_layers"]
    shards = layers + 2
    weight_map: dict[str, str] = {}
    total = 0

    def random(*shape: int) -> torch.Tensor:
        if len(shape) == 1:  # a norm's gain
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=generator, dtype=torch.bfloat16) * 0.02)

    def write(number: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    write(1, {"model.embed_tokens.weight": random(vocab, hidden)})
    shapes = layer_shapes(config)
    for layer in range(layers):
        write(layer + 2, {f"model.layers.{layer}.{name}": random(*shape)
                          for name, shape in shapes.items()})
        print(f"  wrote layer {layer + 1}/{layers} ({total / GIB:.1f} GiB)", flush=True)
    write(shards, {"model.norm.weight": random(hidden), "lm_head.weight": random(vocab, hidden)})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps({"config": config, "seed": seed}))
    return time.perf_counter() - started


def model_bytes(folder: Path) -> int:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])


def resident_peak_bytes(pid: int) -> int:
    """A process's resident peak (VmHWM) and its children's (the p2p daemon)."""
    peak = 0
    for task in [pid, *children_of(pid)]:
        try:
            for line in Path(f"/proc/{task}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) * 1024
        except OSError:
            continue
    return peak


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def run_config(args: argparse.Namespace, folder: Path, run_dir: Path) -> Any:
    from decentrl.config import parse_config

    tokens = max(4096, args.prompts * (args.prompt_tokens + args.max_new_tokens))
    return parse_config({
        "name": "big-shape", "model": str(folder), "num_stages": args.stages,
        "seed": args.seed,
        "host": {"run_dir": str(run_dir), "device": "cpu", "dtype": "bf16",
                 "threads": args.threads,
                 "link": {"rtt_ms": [args.rtt_ms, args.rtt_ms]}},
        "rollout": {"group_size": args.prompts, "max_new_tokens": args.max_new_tokens},
        "train": {"lora_rank": args.lora_rank, "micro_batch_size": args.prompts},
        # Caches sized for the bench's few rows (the default pool would take gigabytes).
        "swarm": {"data_plane": "peer_to_peer", "max_session_tokens": tokens,
                  "kv_pool_tokens": tokens, "max_cached_tokens_per_sender": tokens,
                  "prefix_cache_tokens": 0, "kept_activations_mb": 64,
                  "announce_every_s": 20.0, "request_timeout_s": 900.0,
                  "stage_wait_s": 900.0},
        # One training peer a stage, which serves too: no audit partner, no second copy of the
        # weights for spot-checks (the bench checks nothing), no probation to earn.
        "trust": {"training_peer_verifies": False, "probation_checks": 0,
                  "train_audit_fraction": 0.0, "verify_fraction": 0.0},
    })


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from decentrl.model.loading import cache_root

    folder = args.folder or cache_root() / "bench" / (
        "llama3-8b-random" if (args.layers, args.hidden, args.vocab) == (
            LLAMA3_8B["layers"], LLAMA3_8B["hidden"], LLAMA3_8B["vocab"])
        else f"llama-{args.layers}x{args.hidden}-{args.vocab}-random")
    config_json = shape_config(args)
    print(f"model: {folder}", flush=True)
    written_s = write_random_model(folder, config_json, args.seed)
    whole = model_bytes(folder)
    print(f"  {whole / GIB:.2f} GiB of bf16 weights"
          + (f", written in {written_s:.0f}s" if written_s else " (already written)"),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="decentrl-big-") as tmp:
        result = run_swarm(args, folder, Path(tmp), whole)
    report(args, result, whole)


def run_swarm(args: argparse.Namespace, folder: Path, tmp: Path, whole: int) -> dict[str, Any]:
    from decentrl.client.sessions import RemoteChain
    from decentrl.launch.local_swarm import LocalSwarm
    from decentrl.model.loading import model_spec
    from decentrl.model.stages import StagePlan
    from decentrl.net.directory import Directory
    from decentrl.rollout.generate import generate
    from decentrl.rollout.sampling import SamplingConfig

    config = run_config(args, folder, tmp / "runs")
    spec = model_spec(folder)
    config_path = common.fresh_swarm_folder(config)
    swarm = LocalSwarm(config, config_path, replicas=0, training=True, training_role="both",
                       memory_limits_mb={f"train{stage}": limit
                                         for stage, limit in enumerate(args.limits_mb)},
                       plan_from_offers=args.plan_from_offers)
    processes: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        try:
            swarm.start(lambda child: print(f"  {child.name} ready after "
                                            f"{child.info.get('ready_after_s', 0):.0f}s",
                                            flush=True))
        except RuntimeError as error:
            killed = {name: child.memory.oom_kills() for name, child in swarm.children.items()
                      if child.memory is not None and child.memory.oom_kills()}
            raise SystemExit(f"the swarm did not start: {error}\nkilled by their memory caps "
                             f"(OOM kills by peer): {killed or 'none'}") from None
        config = swarm.config  # planned from the offers, with --plan-from-offers
        if swarm.planned is not None:
            print("  stages planned from the peers' offers:\n    "
                  + swarm.planned.describe().replace("\n", "\n    "), flush=True)
        print(f"  {len(swarm.children)} peers up in {time.perf_counter() - started:.0f}s",
              flush=True)
        plan = StagePlan.of(spec.num_layers, config.num_stages, config.stage_layers)
        assert swarm.bootstrap is not None
        directory = Directory(swarm.bootstrap, config.name, config.num_stages, config.swarm)
        common.wait_for_peers(directory, 1, timeout_s=300)
        chain = RemoteChain(swarm.bootstrap, directory, config.swarm, config.trust, spec,
                            stage_layers=config.stage_layers)
        rng = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(2, spec.vocab_size, (args.prompt_tokens,), generator=rng
                                 ).tolist() for _ in range(args.prompts)]
        sampling = SamplingConfig(temperature=1.0)
        started = time.perf_counter()
        generate(chain, prompts, 1, sampling, set(), 0, args.seed)  # prefill + first token
        first_s = time.perf_counter() - started
        started = time.perf_counter()
        out = generate(chain, prompts, args.max_new_tokens, sampling, set(), 0, args.seed + 1)
        generation_s = time.perf_counter() - started
        new_tokens = sum(len(g.tokens) for g in out)
        print(f"  generated {new_tokens} tokens in {generation_s:.1f}s "
              f"({new_tokens / generation_s:.2f} tok/s; a 1-token call took {first_s:.1f}s)",
              flush=True)
        step_s = train_steps(swarm, directory, config, prompts, out, args.steps)
        for name, child in swarm.children.items():
            stage = int(child.info["stage"])  # the planned one, with --plan-from-offers
            assert child.process is not None and child.memory is not None
            processes.append({
                "name": name, "stage": stage, "layers": len(plan.layers(stage)),
                "cgroup_peak_bytes": child.memory.peak_bytes(),
                "resident_peak_bytes": resident_peak_bytes(child.process.pid),
                "limit_bytes": child.memory.limit_bytes, "oom_kills": child.memory.oom_kills(),
                "alive": child.process.poll() is None})
    finally:
        swarm.shutdown()
    return {"processes": processes, "generation_s": generation_s, "new_tokens": new_tokens,
            "first_token_call_s": first_s, "train_step_s": step_s, "rows": args.prompts,
            "model_bytes": whole, "layers": spec.num_layers, "hidden": spec.hidden_size,
            "stage_layers": [len(plan.layers(stage)) for stage in range(plan.num_stages)],
            "planned": swarm.planned.describe() if swarm.planned is not None else None}


def train_steps(swarm: Any, directory: Any, config: Any, prompts: list[list[int]],
                out: list[Any], steps: int) -> list[float]:
    """Seconds of each LoRA step through the training peers, on the generated rows."""
    from decentrl.client.training import RemoteStageWorker
    from decentrl.client.training_push import PushedTraining
    from decentrl.coordinator.lineage import LineageSigner
    from decentrl.learn.batch import build_batch
    from decentrl.learn.stage_loss import loss_config_from
    from decentrl.learn.trainer import PipelineTrainer
    from decentrl.rollout.sampling import sampling_config
    from decentrl.rollout.types import Rollout

    rollouts = [Rollout(prompt_tokens=p, completion_tokens=g.tokens,
                        behaviour_logprobs=g.logprobs, finished=g.finished)
                for p, g in zip(prompts, out, strict=True)]
    batch = build_batch(rollouts, [1.0 if i % 2 == 0 else -1.0 for i in range(len(rollouts))],
                        [0] * len(rollouts), 0)
    from decentrl.coordinator.manifest import admitted_peers

    client = swarm.bootstrap
    admitted = admitted_peers(config.path).__contains__
    lineage = LineageSigner(client, config, swarm.session)
    try:
        workers = [RemoteStageWorker(client, directory, stage, config.num_stages, config.swarm,
                                     admitted, lineage) for stage in range(config.num_stages)]
        for worker in workers:
            worker.connect()
        chain = PushedTraining(client, workers, config.swarm, config.name, swarm.session)
        trainer = PipelineTrainer(workers, config.train,
                                  loss_config_from(config.train, config.rollout.max_new_tokens),
                                  sampling_config(config.rollout), torch.device("cpu"),
                                  chain=chain)
        times = []
        for step in range(steps):
            started = time.perf_counter()
            trainer.train_step(batch)
            times.append(time.perf_counter() - started)
            print(f"  LoRA step {step + 1}: {times[-1]:.1f}s", flush=True)
        return times
    finally:
        lineage.close()


def report(args: argparse.Namespace, result: dict[str, Any], whole: int) -> None:
    rows = [[p["name"], p["stage"], p["layers"], p["resident_peak_bytes"] / GIB,
             p["cgroup_peak_bytes"] / GIB, p["limit_bytes"] / GIB,
             p["cgroup_peak_bytes"] / whole, p["oom_kills"], "yes" if p["alive"] else "no"]
            for p in sorted(result["processes"], key=lambda p: p["stage"])]
    largest = max(result["processes"], key=lambda p: p["resident_peak_bytes"])
    steps = result["train_step_s"]
    common.print_table(
        "one 8B-shaped model held slice by slice",
        ["process", "stage", "layers", "resident peak GiB", "cgroup peak GiB", "limit GiB",
         "cgroup peak / model", "OOM kills", "alive"], rows,
        f"model {result['layers']} layers x hidden {result['hidden']}: "
        f"{whole / GIB:.2f} GiB of bf16 weights; peers --role both, LoRA rank {args.lora_rank}, "
        f"{args.threads} torch thread(s) each, {args.rtt_ms:g} ms on every link")
    tokens_per_s = result["new_tokens"] / result["generation_s"]
    print(f"generation: {result['rows']} rows x {args.max_new_tokens} new tokens in "
          f"{result['generation_s']:.1f}s = {tokens_per_s:.2f} tok/s; LoRA step: "
          + ", ".join(f"{s:.1f}s" for s in steps)
          + f"; the largest process held {largest['resident_peak_bytes'] / GIB:.2f} GiB "
            f"({largest['name']}), {largest['resident_peak_bytes'] / whole:.0%} of the model")
    figures = {"model_gib": whole / GIB, "tokens_per_s": tokens_per_s,
               "train_step_s": steps[-1], "first_train_step_s": steps[0],
               "largest_resident_gib": largest["resident_peak_bytes"] / GIB,
               "largest_share_of_model": largest["resident_peak_bytes"] / whole,
               "oom_kills": float(sum(p["oom_kills"] for p in result["processes"]))}
    common.print_figures("big_shape", figures)
    common.write_json(args.json, {"bench": "big-shape", "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "result": result, "figures": figures})


if __name__ == "__main__":
    main()
