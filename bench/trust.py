"""Hostile peers and judges caught, honest ones never banned, what checking costs.

Trust that rests on no single peer: per adversary, how often its lies are caught, how fast it is
banned, who gets the blame, and how many of its groups would have trained; over many checks of
honest work, how many honest peers are wrongly banned; and what the checks cost next to
generation.

What runs: a 2-stage swarm in this process over loopback (every peer on its own SwarmNode), on
the demo's task and sampling (sums, group 8, 20 new tokens, temperature 1), and the coordinator's
real trust gate (trust/gate.py: spot-check sampling, probation, the tribunal of trust/tribunal.py,
reputation and bans) with the run's default trust settings. Groups are generated as many sessions at
a time as there are replicas of the busiest stage (one group per session, as the coordinator does; the
client spreads concurrent sessions over the replicas); after each round the gate's queued checks
run to their rulings, so a ban takes effect on the next sessions, as in a run.

Scenarios:
- `honest`: per stage a bf16, an fp32 and a second bf16 replica: every check re-executes across
  dtypes or on another peer;
- one per stage adversary of launch/adversary.py: per stage an honest bf16 and an honest fp32
  replica, plus the hostile peer(s) (collude-verify and huge-capacity come with their
  forge-logprobs partner, whose lies they cover and which they would otherwise judge);
  rotate-keys comes back under a fresh identity each time it is banned.

`--policy old` replays the rules before issue 18 for comparison: one verifier per stage, the one
announcing the most free room, whose opinion is final, and no probation.

Figures per scenario: the culprit's groups, those checked, caught (a confirmed ruling blaming the
culprit at its stage), identities it used and groups served per identity before its ban, its
groups that would have trained (neither held nor dropped when the run ends), wrongful charges
(a `failed` event against an honest peer, producer or verifier) and honest bans, and the cost:
the peers' seconds re-executing (`VerifyService.busy_s`) over their seconds generating (`busy_s`),
as measured and at steady state (the measured cost of one re-execution at the default check rates,
once nobody is on probation).

`--honest-checks N` then re-checks honest groups N times through the tribunal (random panels over
bf16 and fp32 replicas) and counts failed opinions, failed rulings and bans.

Run: decentrl bench trust [--model smollm2-135m-instruct|tiny] [--groups 24] [--policy new|old]
     [--scenarios honest,random-tokens,...] [--honest-checks 0] [--verify-fraction F]
     [--probation-share F] [--json PATH]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from bench import common
from decentrl.client.sessions import RemoteChain
from decentrl.config import RunConfig, parse_config
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.launch.adversary import (
    ADVERSARIES,
    TRAINING_ADVERSARIES,
    adversary_stages,
    hostile_peer,
)
from decentrl.model.loading import load_model
from decentrl.net.directory import Directory
from decentrl.net.link import LinkProfile
from decentrl.net.node import SwarmNode
from decentrl.net.wire import TensorLimits
from decentrl.rollout.types import RolloutGroup
from decentrl.stage.peer import StagePeer
from decentrl.tasks import make_task
from decentrl.trust.gate import Trust
from decentrl.trust.provenance import Provenance
from decentrl.trust.tribunal import Ruling, convene
from decentrl.trust.verify import Verdict, Verifier

# Clients (tests/swarm/test_adversaries.py) and training peers (bench/train_audit.py) are measured
# elsewhere: here, the peers that serve and judge inference.
ELSEWHERE = ("replay", "flood", *TRAINING_ADVERSARIES)
SCENARIOS = ("honest", *(a for a in ADVERSARIES if a not in ELSEWHERE))
# The partner whose lies a colluding judge covers.
PARTNERS = {"collude-verify": "forge-logprobs", "huge-capacity": "forge-logprobs"}


def bench_config(model: str, run_dir: Path, policy: str,
                 verify_fraction: float | None = None,
                 probation_share: float | None = None) -> RunConfig:
    trust: dict[str, Any] = {"probation_checks": 0} if policy == "old" else {}
    if verify_fraction is not None:
        trust["verify_fraction"] = verify_fraction
    if probation_share is not None:
        trust["probation_share"] = probation_share
    return parse_config({
        "name": "trust-bench", "model": model, "num_stages": 2,
        "host": {"run_dir": str(run_dir), "threads": 1},
        "task": {"name": "sums", "options": {"min_digits": 1, "max_digits": 2,
                                             "format_weight": 0.0}},
        "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 20},
        "swarm": {"announce_every_s": 60.0, "request_timeout_s": 120.0},
        "trust": trust,
    })


class OldVerifier(Verifier):
    """The verifier choice before issue 18: per stage the replica announcing the most free
    sessions that did not serve the group."""

    def panel(self, provenance: Provenance, avoid: frozenset[str] = frozenset(),
              contested: int | None = None, established_only: bool = False
              ) -> tuple[str, ...] | None:
        records = self.directory.records()
        chosen = []
        for stage in range(self.config.num_stages):
            pool = (self.directory.verifiers(stage, provenance.peers())
                    or self.directory.verifiers(stage, set()))
            if not pool:
                return None
            chosen.append(max(pool, key=lambda p: records[p].free_sessions))
        return tuple(chosen)


def old_ruling(verifier: Verifier, group: RolloutGroup, provenance: Provenance) -> Ruling:
    """One opinion, final."""
    panel = verifier.panel(provenance)
    verdict = (verifier.verify(group, provenance, panel) if panel is not None else
               Verdict(group.group_id, "skipped", None, None, "no verifier", (), 0.0, ()))
    return Ruling(verdict, (verdict,), verdict.outcome != "skipped", (), ())


class Swarm:
    """The client (the run's owner and coordinator) and the stage peers of one scenario."""

    def __init__(self, config: RunConfig, folder: Path) -> None:
        self.config, self.folder = config, folder
        self.client = SwarmNode.start("client", [], LinkProfile(), TensorLimits())
        self.nodes: list[SwarmNode] = [self.client]
        self.peers: list[StagePeer] = []

    def start(self, stage: int, name: str, adversary: str | None = None,
              config: RunConfig | None = None) -> StagePeer:
        node = SwarmNode.start(name, self.client.addresses(), LinkProfile(), TensorLimits())
        self.nodes.append(node)
        config = config or self.config
        peer = (StagePeer(config, stage, "inference", node, self.client.peer_id, name=name)
                if adversary is None else
                hostile_peer(config, stage, node, self.client.peer_id, name, adversary,
                             self.folder))
        peer.start()
        self.peers.append(peer)
        return peer

    def start_honest(self, third: bool) -> None:
        """Per stage an honest replica in the run's dtype, one in fp32, and with `third` a
        second one in the run's dtype."""
        fp32 = self.config.with_host(self.config.host.model_copy(update={"dtype": "fp32"}))
        for stage in range(self.config.num_stages):
            self.start(stage, f"honest{stage}")
            self.start(stage, f"fp32-{stage}", config=fp32)
            if third:
                self.start(stage, f"honest{stage}b")

    def coordinator(self, loaded: Any) -> tuple[Trust, RolloutWorker, PromptScheduler]:
        """The coordinator's trust gate over these peers, and a worker that generates through
        them as the coordinator does."""
        config = self.config
        directory = Directory(self.client, config.name, config.num_stages, config.swarm)
        trust = Trust(config, self.client, directory, loaded.spec.hidden_size,
                      loaded.tokenizer.pad_token_id, Console(quiet=True))
        directory.version_ceiling = lambda stage: 0  # nothing trains here: the base weights
        directory.refresh()
        chain = RemoteChain(self.client, directory, config.swarm, config.trust, loaded.spec,
                            trust.reputation)
        task = make_task(config.task.name, **config.task.options)
        scheduler = PromptScheduler(config.seed)
        return trust, RolloutWorker(chain, None, task, loaded.tokenizer, config.rollout,
                                    scheduler, config.seed), scheduler

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        for node in self.nodes:
            node.shutdown()

    def cost(self) -> tuple[float, float]:
        return (sum(p.inference.busy_s for p in self.peers if p.inference is not None),
                sum(p.verification.busy_s for p in self.peers if p.verification is not None))


def steady_state_cost(config: RunConfig, serve_s_per_group: float,
                      check_s_per_opinion: float) -> float:
    """Checking over generation once no peer is on probation: `verify_fraction` of the groups
    re-executed once, `second_opinion_fraction` of those again (a failure's confirmation and a
    third opinion are rare with honest peers and left out). A scenario's own ratio is higher: its
    peers are all new, so at first every group is checked twice."""
    if not serve_s_per_group:
        return 0.0
    trust = config.trust
    per_group = trust.verify_fraction * (1 + trust.second_opinion_fraction)
    return per_group * check_s_per_opinion / serve_s_per_group


def run_scenario(scenario: str, config: RunConfig, groups: int, loaded: Any, folder: Path,
                 policy: str) -> dict[str, Any]:
    swarm = Swarm(config, folder)
    try:
        swarm.start_honest(third=scenario == "honest")
        kind = "random-tokens" if scenario == "rotate-keys" else scenario
        hostile: list[StagePeer] = []
        if scenario != "honest":
            for stage in adversary_stages(scenario, config.num_stages):
                hostile.append(swarm.start(stage, f"hostile{stage}", kind))
            if scenario in PARTNERS:
                partner = PARTNERS[scenario]
                for stage in adversary_stages(partner, config.num_stages):
                    hostile.append(swarm.start(stage, f"partner{stage}", partner))
        # The liar whose groups are counted: an inject-answers pair's last-stage half, a colluding
        # judge's partner, or the stage peer itself.
        culprit: StagePeer | None = hostile[-1] if hostile else None
        honest = {p.node.peer_id for p in swarm.peers if p not in hostile}
        trust, worker, scheduler = swarm.coordinator(loaded)
        directory = trust.verifier.directory
        if policy == "new":
            # The honest replicas stand for a swarm whose peers have earned their record: since
            # issue 32 the opinion of a peer on probation decides nothing, so a swarm of
            # newcomers alone would judge nobody.
            for peer in honest:
                for _ in range(config.trust.probation_checks):
                    trust.reputation.record(peer, "passed")
        if policy == "old":
            trust.verifier = OldVerifier(swarm.client, directory, config,
                                         loaded.spec.hidden_size, loaded.tokenizer.pad_token_id)
        judge = hostile[0] if scenario in PARTNERS else None  # the colluding judge
        identities = [culprit.node.peer_id] if culprit is not None else []
        served_before_ban: list[int] = []
        served_now = 0  # the current identity's groups
        culprit_groups: list[str] = []
        checked = caught = opinions = rulings = judged = served_by_judge = 0
        wrongful: list[str] = []

        def generate(index: int) -> tuple[RolloutGroup, Provenance]:
            sessions: list[Any] = []
            [group] = worker.generate_groups([index], on_session=sessions.append)
            return group, sessions[0].provenance

        def culprits(provenance: Provenance) -> bool:
            """Whether the culprit (with its spy, for an inject-answers pair) served it."""
            pair = hostile if scenario == "inject-answers" else [culprit]
            return all(p is not None and p.node.peer_id in provenance.stage_peers(p.index)
                       for p in pair)

        # As many sessions at a time as the busiest stage has replicas: the client spreads
        # concurrent sessions over the replicas, so every replica, hostile or not, gets work.
        concurrency = max(sum(p.index == s for p in swarm.peers)
                          for s in range(config.num_stages))
        started = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            for round_start in range(0, groups, concurrency):
                for group, provenance in pool.map(generate, scheduler.next(
                        min(concurrency, groups - round_start))):
                    trust.produced(group.group_id, provenance)
                    trust.accepted(group)
                    if culprit is not None and culprits(provenance):
                        culprit_groups.append(group.group_id)
                        served_now += 1
                    if judge is not None and judge.node.peer_id in provenance.peers():
                        served_by_judge += 1
                while not trust.queue.empty():
                    group, provenance, reason = trust.queue.get_nowait()
                    ruling = (old_ruling(trust.verifier, group, provenance) if policy == "old"
                              else convene(trust.verifier, group, provenance,
                                           reason == "probation" or trust.random.random()
                                           < config.trust.second_opinion_fraction))
                    rulings += 1
                    opinions += len(ruling.opinions)
                    judged += judge is not None and any(
                        judge.node.peer_id in o.panel for o in ruling.opinions)
                    events_before = trust.reputation.events_recorded
                    trust.judge(ruling, provenance, reason)
                    new_events, _ = trust.reputation.events_after(events_before)
                    wrongful += [f"{e.peer[-8:]} at stage {e.stage}: {e.detail[:80]}"
                                 for e in new_events if e.peer in honest
                                 and e.outcome == "failed"]
                    verdict = ruling.verdict
                    if group.group_id in culprit_groups:
                        checked += verdict.outcome != "skipped"
                        caught += (verdict.outcome == "failed" and ruling.confirmed
                                   and verdict.stage == hostile[-1].index)
                    print(f"  {scenario}: group {group.group_id} ({reason}) "
                          f"{'culprit' if group.group_id in culprit_groups else 'honest'}: "
                          f"{verdict.outcome} after {len(ruling.opinions)} opinion(s) "
                          f"{verdict.detail[:80]}", flush=True)
                if culprit is not None and trust.reputation.banned(culprit.node.peer_id):
                    served_before_ban.append(served_now)
                    served_now = 0
                    if scenario != "rotate-keys":
                        culprit = None  # banned: it gets no more sessions
                        continue
                    culprit = swarm.start(culprit.index, f"hostile-{len(identities)}", kind)
                    hostile.append(culprit)
                    identities.append(culprit.node.peer_id)
                    directory.refresh()
        seconds = time.monotonic() - started
        for group_id in culprit_groups:
            print(f"  {scenario}: the culprit's group {group_id}: "
                  f"{trust.distrusted_producer(group_id) or 'would train'}", flush=True)
        trained = [g for g in culprit_groups
                   if trust.distrusted_producer(g) is None and not trust.awaiting_verdict(g)]
        serving, checking = swarm.cost()
        honest_bans = sorted(p[-8:] for p in honest if trust.reputation.banned(p))
        return {"scenario": scenario, "policy": policy, "groups": groups,
                "culprit_groups": len(culprit_groups), "checked": checked, "caught": caught,
                "identities": len(identities), "served_before_ban": served_before_ban,
                "reached_training": len(trained), "wrongful": wrongful,
                "honest_bans": honest_bans, "opinions": opinions,
                "banned_causes": trust.banned_peers(), "seconds": seconds,
                "judge_banned": judge is not None and trust.reputation.banned(
                    judge.node.peer_id),
                "judged_share": judged / rulings if rulings else 0.0,
                "judge_served_share": served_by_judge / groups,
                "serve_s": serving, "check_s": checking,
                "check_over_generation": checking / serving if serving else 0.0,
                "steady_state_cost": steady_state_cost(config, serving / groups,
                                                       checking / opinions if opinions else 0.0)}
    finally:
        swarm.close()


def honest_checks(config: RunConfig, loaded: Any, folder: Path, checks: int, groups: int
                  ) -> dict[str, Any]:
    """`checks` rulings on honest groups (random among `groups` generated), panels drawn at
    random over a bf16, an fp32 and a second bf16 replica per stage."""
    swarm = Swarm(config, folder)
    try:
        swarm.start_honest(third=True)
        trust, worker, scheduler = swarm.coordinator(loaded)
        made: list[tuple[RolloutGroup, Provenance]] = []
        for index in scheduler.next(groups):
            sessions: list[Any] = []
            [group] = worker.generate_groups([index], on_session=sessions.append)
            made.append((group, sessions[0].provenance))
        rng = random.Random(0)
        opinions = failed_opinions = failed_rulings = 0
        started = time.monotonic()
        for number in range(checks):
            group, provenance = rng.choice(made)
            ruling = convene(trust.verifier, group, provenance, repeat_pass=False)
            trust.judge(ruling, provenance, "sampled")
            opinions += len(ruling.opinions)
            failed_opinions += sum(o.outcome == "failed" for o in ruling.opinions)
            failed_rulings += ruling.verdict.outcome == "failed"
            if number % 100 == 0:
                print(f"  honest checks: {number}/{checks}, {failed_opinions} failed opinions, "
                      f"{time.monotonic() - started:.0f}s", flush=True)
        bans = sum(trust.reputation.banned(p.node.peer_id) for p in swarm.peers)
        return {"checks": checks, "opinions": opinions, "failed_opinions": failed_opinions,
                "failed_rulings": failed_rulings, "honest_bans": bans,
                "seconds": time.monotonic() - started}
    finally:
        swarm.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench trust", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--policy", choices=("new", "old"), default="new")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--honest-checks", type=int, default=0)
    # Established peers' groups are checked at `trust.verify_fraction` (10%): a short run that
    # must measure what a check costs asks for more.
    parser.add_argument("--verify-fraction", type=float, default=None,
                        help="fraction of established peers' groups checked (default: the "
                        "config's)")
    # The newcomers of a stage share `trust.probation_share` of its sessions (net/probation.py):
    # a run of a few groups may give a liar none; a short run that must see one asks for more.
    parser.add_argument("--probation-share", type=float, default=None,
                        help="share of a stage's sessions its newcomers may get (default: the "
                        "config's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="decentrl-trust-") as tmp:
        folder = Path(tmp)
        config = bench_config(common.bench_model(args.model), folder / "runs", args.policy,
                              args.verify_fraction, args.probation_share)
        loaded = load_model(config.model)
        results = [run_scenario(s, config, args.groups, loaded, folder, args.policy)
                   for s in scenarios]
        honest = (honest_checks(config, loaded, folder, args.honest_checks, 16)
                  if args.honest_checks else None)
    rows = []
    for r in results:
        culprit = r["scenario"] != "honest"
        bans = r["served_before_ban"]
        rows.append([r["scenario"], r["culprit_groups"] if culprit else "-",
                     f"{r['caught']}/{r['checked']}" if culprit else "-",
                     r["identities"] if culprit else "-",
                     ", ".join(map(str, bans)) or ("never" if culprit else "-"),
                     f"{r['reached_training']}/{r['culprit_groups']}" if culprit else "-",
                     len(r["wrongful"]), len(r["honest_bans"]), r["opinions"],
                     r["check_over_generation"], r["steady_state_cost"]])
        common.print_figures(f"trust_{args.policy}_{r['scenario'].replace('-', '_')}", {
            "culprit_groups": r["culprit_groups"], "caught": r["caught"],
            "checked": r["checked"], "reached_training": r["reached_training"],
            "wrongful": len(r["wrongful"]), "honest_bans": len(r["honest_bans"]),
            "cost_ratio": r["check_over_generation"],
            "steady_state_cost": r["steady_state_cost"]})
        for line in r["wrongful"]:
            print(f"  wrongful ({r['scenario']}): {line}")
    common.print_table(
        f"trust, {args.policy} rules ({args.model}, {args.groups} groups per scenario, "
        f"default trust settings)",
        ["scenario", "culprit's groups", "caught / checked", "identities",
         "groups served before each ban", "culprit's groups trained", "wrongful charges",
         "honest bans", "re-executions", "check / generate", "steady state"], rows,
        caption="caught: a confirmed ruling blamed the culprit at its stage; trained: neither "
                "held for a ruling nor dropped when the scenario ended; check / generate: "
                "re-execution seconds over generation seconds in the scenario (probation "
                "included); steady state: the same cost per re-execution at the default "
                "check rates once nobody is on probation")
    judges = [r for r in results if r["scenario"] in PARTNERS]
    if judges:
        common.print_table(
            f"colluding judges ({args.policy} rules)",
            ["scenario", "rulings it sat on", "sessions it served", "judge banned"],
            [[r["scenario"], r["judged_share"], r["judge_served_share"], r["judge_banned"]]
             for r in judges],
            caption="shares of all rulings and all groups; a fair share is 1/3 of the last "
                    "stage's (two honest replicas and the judge besides the partner)")
    if honest is not None:
        common.print_table(
            f"honest work re-checked ({args.model})",
            ["rulings", "re-executions", "failed opinions", "failed rulings", "honest bans",
             "seconds"],
            [[honest["checks"], honest["opinions"], honest["failed_opinions"],
              honest["failed_rulings"], honest["honest_bans"], honest["seconds"]]])
        common.print_figures("trust_honest_checks", {k: float(v) for k, v in honest.items()})
    common.write_json(args.json, {"model": args.model, "policy": args.policy,
                                  "results": results, "honest_checks": honest})


if __name__ == "__main__":
    main()
