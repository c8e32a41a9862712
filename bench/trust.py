"""Hostile peers caught, honest ones blamed, checks' cost.

Trust: how often each hostile peer is caught, how often an honest one is wrongly blamed, and
what spot-checks cost next to generation.

What runs: a 2-stage swarm in this process over loopback (every peer on its own SwarmNode), on
the demo's task and sampling (sums, group 8, 20 new tokens, temperature 1). Per scenario:
- `honest`: two honest replicas per stage, one in the run's compute dtype and one in fp32, so
  every check re-executes on the other dtype;
- one scenario per stage adversary (swarm/adversary.py): one honest replica per stage plus the
  hostile peer(s), which the client picks for about half of the sessions.
`--groups` N groups are generated two sessions at a time (`RolloutWorker`, one group per session,
as the coordinator does; the client spreads concurrent sessions over the replicas), then each is
re-executed by the `Verifier` (trust/verify.py) exactly as the coordinator's spot-checks do, and
scored by the trainer's poison flags (the base model is the policy: versions do not move here).

Figures per scenario: groups the culprit touched, spot-check detection (failed, blamed on the
culprit at its stage), trainer-flag detection (a row of the group flagged), wrongful blame (a
failed check blaming an honest peer, over all groups), and cost: re-execution wall time over
compute: the peers' time re-executing (`VerifyService.busy_s`) over their time
serving generation (`busy_s`), when every group is checked; at `trust.verify_fraction` f the
spot-checks cost f x that ratio of generation compute (target < 10%).

Run: decentrl bench trust [--model smollm2-135m-instruct|tiny] [--groups 8] [--json PATH]
     [--scenarios honest,random-tokens,...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

from decentrl.config import RunConfig, parse_config  # noqa: E402
from decentrl.learn.batch import build_batch  # noqa: E402
from decentrl.learn.losses import flagged_rows  # noqa: E402
from decentrl.learn.trainer import LossInputs, loss_config_from, micro_batch_loss, stage_forward  # noqa: E402,E501
from decentrl.model.loading import load_model  # noqa: E402
from decentrl.model.stages import StagePlan, build_stages  # noqa: E402
from decentrl.net.directory import Directory  # noqa: E402
from decentrl.net.link import LinkProfile  # noqa: E402
from decentrl.net.node import SwarmNode  # noqa: E402
from decentrl.net.wire import TensorLimits  # noqa: E402
from decentrl.rollout.types import RolloutGroup  # noqa: E402
from decentrl.swarm.adversary import adversary_stages, hostile_peer  # noqa: E402
from decentrl.swarm.peer import StagePeer  # noqa: E402
from decentrl.swarm.sessions import RemoteChain  # noqa: E402
from decentrl.swarm.scheduler import PromptScheduler  # noqa: E402
from decentrl.rollout.sampling import sampling_config
from decentrl.swarm.worker import RolloutWorker  # noqa: E402
from decentrl.tasks import make_task  # noqa: E402
from decentrl.trust.verify import Verifier  # noqa: E402

SCENARIOS = ("honest", "random-tokens", "forge-logprobs", "inject-answers", "corrupt-activations")


def bench_config(model: str, run_dir: Path) -> RunConfig:
    return parse_config({
        "name": "trust-bench", "run_dir": str(run_dir), "model": model, "num_stages": 2,
        "threads": 1,
        "task": {"name": "sums", "options": {"min_digits": 1, "max_digits": 2,
                                             "format_weight": 0.0}},
        "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 20},
        "swarm": {"announce_every_s": 60.0, "request_timeout_s": 120.0},
    })


def start(peers: list[StagePeer], nodes: list[SwarmNode], addresses: list[str], config: RunConfig,
          stage: int, name: str, adversary: str | None = None,
          collusion: Path | None = None) -> StagePeer:
    """A peer of the run the client (nodes[0], the coordinator) owns."""
    node = SwarmNode.start(name, addresses, LinkProfile(), TensorLimits())
    nodes.append(node)
    owner = nodes[0].peer_id
    if adversary is None:
        peer = StagePeer(config, stage, "inference", node, owner, name=name)
    else:
        peer = hostile_peer(config, stage, node, owner, name, adversary, collusion)
    peer.start()
    peers.append(peer)
    return peer


def trainer_flags(stages: list[Any], group: RolloutGroup, config: RunConfig, pad_id: int
                  ) -> bool:
    """Whether the trainer's poison flags catch a row of `group` (the policy: the base model)."""
    rows = group.rollouts
    batch = build_batch(rows, [0.0] * len(rows), [0] * len(rows), pad_id)
    loss = loss_config_from(config.train, config.rollout.max_new_tokens, config.trust)
    with torch.no_grad():
        x: Any = (batch.prompts, batch.completions)
        for stage in stages:
            x = stage_forward(stage, x, batch)
        inputs = LossInputs(None, None, batch.num_sequences, batch.num_target_tokens)
        _, _, (surprise, ratio) = micro_batch_loss(x, batch, inputs, loss,
                                                   sampling_config(config.rollout))
    return bool(flagged_rows(surprise, ratio, loss).any())


def run_scenario(scenario: str, config: RunConfig, groups: int, local_stages: list[Any],
                 loaded: Any, folder: Path) -> dict[str, Any]:
    fp32 = config.model_copy(update={"dtype": "fp32"})
    client = SwarmNode.start("client", [], LinkProfile(), TensorLimits())
    nodes, peers = [client], []
    try:
        addresses = client.addresses()
        hostile: list[StagePeer] = []
        for stage in range(config.num_stages):
            start(peers, nodes, addresses, config, stage, f"honest{stage}")
            if scenario == "honest":
                start(peers, nodes, addresses, fp32, stage, f"fp32-{stage}")
        if scenario != "honest":
            for stage in adversary_stages(scenario, config.num_stages):
                hostile.append(start(peers, nodes, addresses, config, stage, f"hostile{stage}",
                                     scenario, folder))
        # The peer that lies (an inject-answers pair's last-stage half); a group is the
        # culprit's when every hostile peer served it (the pair injects only together).
        culprit = hostile[-1].node.peer_id if hostile else None
        culprit_stage = hostile[-1].index if hostile else None
        directory = Directory(client, config.name, config.num_stages, config.swarm)
        directory.refresh()
        chain = RemoteChain(client, directory, config.swarm, config.trust, loaded.spec)
        task = make_task(config.task.name, **config.task.options)
        scheduler = PromptScheduler(config.seed)
        worker = RolloutWorker(chain, None, task, loaded.tokenizer, config.rollout, scheduler,
                               config.seed)
        verifier = Verifier(client, directory, config, loaded.spec.hidden_size,
                            loaded.tokenizer.pad_token_id)
        touched = caught = flagged = wrongful = skipped = 0
        honest_gaps, honest_margins = [], []

        def generate(index: int) -> tuple[RolloutGroup, Any]:
            sessions: list[Any] = []
            [group] = worker.generate_groups([index], on_session=sessions.append)
            return group, sessions[0].provenance

        with ThreadPoolExecutor(2) as pool:
            generated = list(pool.map(generate, scheduler.next(groups)))
        for index, (group, provenance) in enumerate(generated):
            verdict = verifier.verify(group, provenance)
            involved = bool(hostile) and all(
                peer.node.peer_id in provenance.stage_peers(peer.index) for peer in hostile)
            touched += involved
            skipped += verdict.outcome == "skipped"
            if not involved and verdict.token_gaps is not None:
                honest_gaps.append(verdict.token_gaps)
                honest_margins.append(verdict.token_margins)
            if verdict.outcome == "failed":
                if involved and verdict.peer == culprit and verdict.stage == culprit_stage:
                    caught += 1
                else:
                    wrongful += 1
            if trainer_flags(local_stages, group, config, loaded.tokenizer.pad_token_id) \
                    and (involved or culprit is None):
                flagged += 1
            print(f"  {scenario} group {index}: {'culprit' if involved else 'honest'}, "
                  f"{verdict.outcome} {verdict.detail[:100]}", flush=True)
        services = [peer.inference for peer in peers if peer.inference is not None]
        serving = sum(service.busy_s for service in services)
        checking = sum(peer.verification.busy_s for peer in peers
                       if peer.verification is not None)
        nothing = [torch.full((1,), float("nan"))]  # every group went through the culprit
        gaps, margins = torch.cat(honest_gaps or nothing), torch.cat(honest_margins or nothing)
        return {"scenario": scenario, "groups": groups, "touched": touched, "caught": caught,
                "flagged": flagged, "wrongful": wrongful, "skipped": skipped,
                "honest_tokens": gaps.numel(), "honest_gap_p99": float(gaps.quantile(0.99)),
                "honest_gap_max": float(gaps.max()),
                "honest_margin_p99": float(margins.quantile(0.99)),
                "honest_margin_max": float(margins.max()),
                "honest_over_tolerance": float(
                    ((gaps > config.trust.logprob_tolerance)
                     | (margins > config.trust.sampling_tolerance)).float().mean()),
                "serve_s": serving, "check_s": checking,
                "check_over_generation": checking / serving}
    finally:
        for peer in peers:
            peer.stop()
        for node in nodes:
            node.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench trust", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="decentrl-trust-") as tmp:
        folder = Path(tmp)
        config = bench_config(common.bench_model(args.model), folder / "runs")
        loaded = load_model(config.model)
        plan = StagePlan.even(loaded.spec.num_layers, config.num_stages)
        local = build_stages(loaded.spec, plan, loaded.tensors, torch.device("cpu"),
                             torch.float32)
        results = [run_scenario(s, config, args.groups, local, loaded, folder)
                   for s in scenarios]
    fraction = config.trust.verify_fraction
    rows = []
    for r in results:
        honest = r["scenario"] == "honest"
        rows.append([r["scenario"], r["groups"], "-" if honest else r["touched"],
                     "-" if honest else f"{r['caught']}/{r['touched']}",
                     f"{r['flagged']}/{r['groups'] if honest else r['touched']}",
                     f"{r['wrongful']}/{r['groups']}", r["skipped"],
                     r["check_over_generation"], fraction * r["check_over_generation"]])
        common.print_figures(f"trust_{r['scenario'].replace('-', '_')}", {
            "touched": r["touched"], "caught": r["caught"], "flagged": r["flagged"],
            "wrongful": r["wrongful"], "cost_ratio": r["check_over_generation"]})
    common.print_table(
        f"spot-checks and trainer flags ({args.model}, {args.groups} groups per scenario)",
        ["scenario", "groups", "culprit's groups", "checks caught", "trainer flagged",
         "wrongful blame", "skipped", "check / generate", f"cost at f={fraction}"], rows)
    common.print_table(
        "honest tokens re-executed (every scenario's groups the culprit did not touch)",
        ["scenario", "tokens", "log-prob gap p99", "max", "sampling margin p99", "max",
         "beyond tolerance"],
        [[r["scenario"], r["honest_tokens"], r["honest_gap_p99"], r["honest_gap_max"],
          r["honest_margin_p99"], r["honest_margin_max"], r["honest_over_tolerance"]]
         for r in results],
        caption=f"tolerances: log-prob {config.trust.logprob_tolerance}, margin "
                f"{config.trust.sampling_tolerance}; a check fails above "
                f"{config.trust.max_mismatch_fraction:.0%} of a group's tokens")
    common.write_json(args.json, {"model": args.model, "results": results})


if __name__ == "__main__":
    main()
