"""The trust claims of docs/trust.md that no other test pins down, each against the code that makes
it true, with no network: the coordinator's trust gate (trust/gate.py) on a node that is never
started, spot-checks answered by a scripted verifier instead of re-execution on replicas, the
directory (net/directory.py) filled with announcements by hand, and the training loop
(coordinator/loop.py) of a local run whose gate distrusts every second group.

- Spot-checks: a random `trust.verify_fraction` of accepted groups is re-executed.
- Reputation: a banned peer's unverified groups are dropped, and it is never chosen again.
- Trainer flags: the groups of the rows the trainer's log-probs flag get re-executed.
- Routing: inference replicas are chosen by load and latency, never by what they claim."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import pytest
import torch
from helpers import build
from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.backend import TrustEveryone
from decentrl.coordinator.ingest import Ingestion
from decentrl.coordinator.local_backend import local_run
from decentrl.coordinator.scheduler import PromptScheduler
from decentrl.coordinator.worker import RolloutWorker
from decentrl.learn.stage_loss import loss_config_from
from decentrl.learn.trainer import PipelineTrainer
from decentrl.model.loading import LoadedModel
from decentrl.net.directory import Directory, PeerState
from decentrl.net.node import SwarmNode
from decentrl.net.protocol import PeerRecord
from decentrl.rollout.chain import LocalChain
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import Rollout, RolloutGroup, ScoredGroup, VersionSpan
from decentrl.tasks import make_task
from decentrl.trust.gate import Trust
from decentrl.trust.provenance import Provenance
from decentrl.trust.tribunal import convene
from decentrl.trust.verify import Verdict, Verifier

NUM_STAGES = 2
HIDDEN_SIZE = 32  # the tiny model's; the scripted verifier never looks at hidden states
PAD_ID = 0


class OfflineNode:
    """What the gate configures on its node (when a peer refuses a sender, and who hears of each
    strike), without a p2p daemon: nothing in these tests goes over the network."""

    def __init__(self) -> None:
        self.strikes_to_block = 0
        self.block_s = 0.0
        self.on_strike: Callable[[str, str], None] | None = None


class ScriptedVerifier(Verifier):
    """Stands in for re-execution on other replicas: records every group it is asked to check and
    answers that it passed, unless `blame` names the stage and replica its check would catch.
    Sets `drained` once the gate's queue is empty, which ends `Trust.verify_forever`."""

    def __init__(self, trust: Trust) -> None:
        super().__init__(trust.verifier.node, trust.verifier.directory, trust.config,
                         HIDDEN_SIZE, PAD_ID)
        self.pending = trust.queue
        self.checked: list[str] = []
        self.blame: dict[str, tuple[int, str]] = {}  # group id -> (stage, replica)
        self.drained = threading.Event()

    def panel(self, provenance: Provenance, avoid: frozenset[str] = frozenset(),
              contested: int | None = None, established_only: bool = False
              ) -> tuple[str, ...]:
        """Verifiers no opinion on the group has used yet."""
        return tuple(f"verifier-{len(avoid)}-{stage}" for stage in range(NUM_STAGES))

    def verify(self, group: RolloutGroup, provenance: Provenance,
               panel: tuple[str, ...]) -> Verdict:
        if panel[0].startswith("verifier-0-"):  # the first opinion (the others repeat it)
            self.checked.append(group.group_id)
        if self.pending.empty():
            self.drained.set()
        every_stage = tuple(range(NUM_STAGES))
        if group.group_id not in self.blame:
            return Verdict(group.group_id, "passed", None, None, "", every_stage, 0.0, panel)
        stage, peer = self.blame[group.group_id]
        return Verdict(group.group_id, "failed", stage, peer, "tokens do not re-execute",
                       every_stage[:stage + 1], 0.0, panel)


def offline_gate(config: RunConfig, seed: int | None = None) -> Trust:
    """The coordinator's gate for `config` over an empty directory. With `seed`, which groups
    it samples for a spot-check is reproducible (a run seeds it unpredictably)."""
    node = cast(SwarmNode, OfflineNode())
    directory = Directory(node, config.name, config.num_stages, config.swarm)
    trust = Trust(config, node, directory, HIDDEN_SIZE, PAD_ID, Console(quiet=True))
    if seed is not None:
        trust.random = random.Random(seed)
    return trust


def scripted_gate(config: RunConfig, seed: int | None = None) -> tuple[Trust, ScriptedVerifier]:
    """`offline_gate` whose spot-checks the scripted verifier answers."""
    trust = offline_gate(config, seed)
    verifier = ScriptedVerifier(trust)
    trust.verifier = verifier
    return trust, verifier


def run_queued_checks(trust: Trust, verifier: ScriptedVerifier) -> list[str]:
    """Run every spot-check the gate has queued through its own verification loop, as its
    verification thread would; the ids of the groups checked."""
    if trust.queue.empty():
        return []  # verify_forever would wait for work that never comes
    done_before = len(verifier.checked)
    verifier.drained.clear()
    trust.verify_forever(verifier.drained)
    return verifier.checked[done_before:]


def served_by(*peers: str) -> Provenance:
    """A session that `peers[stage]` served from start to end, one replica per stage."""
    provenance = Provenance.empty(len(peers))
    for stage, peer in enumerate(peers):
        provenance.stages[stage].serve(0, peer)
    return provenance


def made_up_group(group_id: str) -> RolloutGroup:
    """A group for the gate's bookkeeping, which never reads its tokens."""
    rollout = Rollout(prompt_tokens=[5, 6], completion_tokens=[7], behaviour_logprobs=[-1.0],
                      finished=True)
    return RolloutGroup(group_id=group_id, task="sums", problem_index=0,
                        stage_versions=[0] * NUM_STAGES,
                        version_spans=[VersionSpan(start=0, versions=[0] * NUM_STAGES)],
                        sampling_seed=0, rollouts=[rollout, rollout])


def produce_and_accept(trust: Trust, group_id: str, provenance: Provenance) -> RolloutGroup:
    """What the coordinator tells the gate of a group its sessions generated and ingestion
    accepted."""
    group = made_up_group(group_id)
    trust.produced(group_id, provenance)
    trust.accepted(group)
    return group


# ---- spot-checks sample verify_fraction of the accepted groups --------------------------------

SAMPLED_GROUPS = 4000


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3, 1.0])
def test_spot_checks_re_execute_verify_fraction_of_the_accepted_groups(
        tiny_model_dir: Path, fraction: float) -> None:
    config = tiny_run_config(tiny_model_dir, NUM_STAGES, trust={"verify_fraction": fraction})
    trust, verifier = scripted_gate(config, seed=1234)
    accepted, checked = [], []
    for number in range(SAMPLED_GROUPS):
        group_id = f"group-{number}"
        produce_and_accept(trust, group_id, served_by("replica-0", "replica-1"))
        accepted.append(group_id)
        # The gate never blocks on a full backlog, it skips the check: run them as they come.
        checked += run_queued_checks(trust, verifier)
    assert trust.count["verify_skipped"] == 0
    assert trust.count["verified"] == len(checked)
    if fraction == 0.0:
        assert checked == []
    elif fraction == 1.0:
        assert checked == accepted
    else:
        # Within 4 standard deviations of the binomial (0.007 at 0.3): the seed fixes the draw,
        # the bound leaves room for a change in how the gate consumes its random numbers.
        slack = 4 * math.sqrt(fraction * (1 - fraction) / SAMPLED_GROUPS)
        assert abs(len(checked) / SAMPLED_GROUPS - fraction) < slack, len(checked)
        assert set(checked) < set(accepted)


# ---- a banned peer's unverified groups are dropped ------------------------------------------

def replica_record(name: str, stage: int, free_sessions: int = 4) -> PeerRecord:
    return PeerRecord(name=name, stage=stage, layers=(2 * stage, 2 * stage + 2),
                      role="inference", version=0, tokens_per_s=0.0,
                      free_sessions=free_sessions, training_ready=False)


def announce(directory: Directory, records: dict[str, PeerRecord]) -> None:
    """What a refresh from the DHT would find: these replicas' announcements."""
    for peer, record in records.items():
        directory.peers[peer] = PeerState(record)


def test_a_banned_peers_unverified_groups_are_dropped_and_it_is_never_chosen_again(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, NUM_STAGES, trust={"verify_fraction": 1.0})
    trust, verifier = scripted_gate(config)
    directory = trust.verifier.directory
    announce(directory, {"first": replica_record("first", 0), "liar": replica_record("liar", 1),
                         "honest": replica_record("honest", 1)})
    # Before its lies the liar served a group whose check passed.
    produce_and_accept(trust, "checked-before-ban", served_by("first", "liar"))
    assert run_queued_checks(trust, verifier) == ["checked-before-ban"]
    # Groups generated meanwhile that wait, unverified, to be ingested (the gate judges a group
    # waiting in the pending buffer the same way): one the liar served throughout, one it took
    # over from the honest replica after a failover, one it had no part in.
    trust.produced("by-liar", served_by("first", "liar"))
    failover = served_by("first", "honest")
    failover.stages[1].serve(3, "liar")
    trust.produced("by-liar-after-failover", failover)
    trust.produced("honest", served_by("first", "honest"))
    for group_id in ("by-liar", "by-liar-after-failover", "honest", "checked-before-ban"):
        assert trust.distrusted_producer(group_id) is None, group_id

    # Three failed spot-checks after one passed take the liar's score to 2/5, under 0.5.
    lies = ["lie-1", "lie-2", "lie-3"]
    for lie in lies:
        verifier.blame[lie] = (1, "liar")
        produce_and_accept(trust, lie, served_by("first", "liar"))
    assert run_queued_checks(trust, verifier) == lies
    assert trust.reputation.banned("liar") and trust.count["banned"] == 1
    assert not trust.reputation.banned("first") and not trust.reputation.banned("honest")

    assert trust.distrusted_producer("lie-1") == "failed verification"
    for dropped in ("by-liar", "by-liar-after-failover"):
        reason = trust.distrusted_producer(dropped)
        assert reason is not None and "banned peers ['liar']" in reason, dropped
    assert trust.distrusted_producer("honest") is None
    assert trust.distrusted_producer("checked-before-ban") is None  # verified: it stays

    # Never chosen again for a session or a check, not even when the stage has no one else.
    assert directory.choose_inference(1) == "honest"
    assert directory.verifiers(1, exclude=set()) == ["honest"]
    directory.ban("honest", "unreachable")
    assert directory.choose_inference(1, allow_banned=True) == "honest"
    assert directory.verifiers(1, exclude=set()) == []


# ---- the trainer's flags lead to re-execution -----------------------------------------------

def test_the_groups_of_rows_the_trainer_flags_are_re_executed(
        tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    # No group is sampled for a spot-check: any check comes from a flag.
    config = tiny_run_config(tiny_model_dir, NUM_STAGES, rollout={"group_size": 4}, trust={
        "verify_fraction": 0.0, "flag_log_ratio": 1.0, "flag_surprise": 3.0})
    task = make_task(config.task.name, **config.task.options)
    scheduler = PromptScheduler(config.seed)
    worker = RolloutWorker(LocalChain(build(tiny_model, NUM_STAGES)), None, task,
                           tiny_model.tokenizer, config.rollout, scheduler, config.seed)
    honest, forged = worker.generate_groups([0]) + worker.generate_groups([1])
    # One row of the second group claims behaviour log-probs 3 nats below what sampled it.
    rows = list(forged.rollouts)
    rows[1] = msgspec.structs.replace(
        rows[1], behaviour_logprobs=[p - 3.0 for p in rows[1].behaviour_logprobs])
    forged = msgspec.structs.replace(forged, rollouts=rows)

    trust, verifier = scripted_gate(config)
    for group in (honest, forged):
        produce_and_accept(trust, group.group_id, served_by("replica-0", "replica-1"))
    assert run_queued_checks(trust, verifier) == []

    # The coordinator's training step: a batch of both groups, then the groups of the rows the
    # last stage flagged go to the gate.
    ingestion = Ingestion(config, task, tiny_model.tokenizer, scheduler)
    batch, _, row_groups = ingestion.make_batch(
        [(ScoredGroup(group=g, rewards=[1.0, 0.0, 1.0, 0.0], correct=[0.0] * 4), 0)
         for g in (honest, forged)])
    assert batch is not None
    trainer = PipelineTrainer.local(
        build(tiny_model, NUM_STAGES), config.train,
        loss_config_from(config.train, config.rollout.max_new_tokens, config.trust),
        sampling_config(config.rollout), torch.float32)
    trainer.train_step(batch)
    assert trainer.flagged is not None
    flagged_rows = trainer.flagged.nonzero()[:, 0].tolist()
    assert [row_groups[row] for row in flagged_rows] == [forged.group_id]
    groups = {g.group_id: g for g in (honest, forged)}
    trust.flagged([groups[row_groups[row]] for row in flagged_rows])

    assert run_queued_checks(trust, verifier) == [forged.group_id]
    assert trust.count["flagged"] == 1 and trust.count["verified"] == 1


class DistrustingGate(TrustEveryone):
    """The training loop's trust gate after a ban: every second group it is asked about was
    produced with the banned peer and is unverified (trust/gate.py `Trust` says why such a group
    is dropped; here, what the loop does with that answer). Records what the loop tells it."""

    def __init__(self) -> None:
        self.asked = 0
        self.refused: list[str] = []
        self.trained_ids: list[str] = []
        self.flagged_ids: list[str] = []

    def distrusted_producer(self, group_id: str) -> str | None:
        self.asked += 1
        if self.asked % 2:
            return None
        self.refused.append(group_id)
        return "produced with banned peers ['liar']"

    def trained(self, group_id: str) -> None:
        self.trained_ids.append(group_id)

    def flagged(self, groups: list[RolloutGroup]) -> None:
        self.flagged_ids += [g.group_id for g in groups]


LOOP_GROUP_SIZE = 2


def test_the_training_loop_trains_no_distrusted_group_and_hands_the_gate_flagged_rows_groups(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # A surprise bound this tight flags about half of the nearly uniform tiny model's rows.
    config = tiny_run_config(
        tiny_model_dir, NUM_STAGES, host={"run_dir": str(tmp_path), "threads": 1},
        rollout={"group_size": LOOP_GROUP_SIZE, "prompts_per_step": 4, "max_new_tokens": 4},
        train={"mode": "sync", "steps": 3, "micro_batch_size": 8, "zero_variance_groups": "keep"},
        trust={"flag_surprise": 1e-6})
    gate = DistrustingGate()
    loop = local_run(config, Console(quiet=True), gate=gate)
    flagged_rows = 0
    try:
        for _ in range(config.train.steps):
            trained_before, flagged_before = len(gate.trained_ids), len(gate.flagged_ids)
            assert loop.train_one_step() is not None
            step_groups = gate.trained_ids[trained_before:]
            assert loop.trainer.flagged is not None
            rows = loop.trainer.flagged.nonzero()[:, 0].tolist()
            # Every row of every group is in the batch (zero-variance groups are kept), in order.
            assert gate.flagged_ids[flagged_before:] == [step_groups[row // LOOP_GROUP_SIZE]
                                                         for row in rows]
            flagged_rows += len(rows)
        counts = loop.store.counts()
    finally:
        loop.close()
    assert flagged_rows > 0
    assert len(gate.refused) == len(gate.trained_ids) == 6
    assert not set(gate.refused) & set(gate.trained_ids)
    assert loop.ingestion.stats.reasons == {"distrusted": len(gate.refused)}
    assert counts["trained"] == len(gate.trained_ids) and counts["pending"] == 0


def test_a_flagged_group_that_fails_its_check_is_dropped_and_its_liar_blamed(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, NUM_STAGES, trust={"verify_fraction": 0.0})
    trust, verifier = scripted_gate(config)
    group = produce_and_accept(trust, "flagged", served_by("replica-0", "liar"))
    verifier.blame["flagged"] = (1, "liar")
    # Every row of a group may be flagged: the group is checked once.
    trust.flagged([group, group, group])
    assert run_queued_checks(trust, verifier) == ["flagged"]
    assert trust.distrusted_producer("flagged") == "failed verification"
    assert trust.reputation.counts("liar") == {"failed": 1}
    assert trust.reputation.counts("replica-0") == {"passed": 1}


def test_a_flagged_group_no_replica_can_check_costs_its_producers_nothing(
        tiny_model_dir: Path) -> None:
    # With one replica per stage and nobody else to re-execute, an operator once saw the honest
    # last-stage replica banned for flags nobody could check: what nobody checked charges nobody.
    config = tiny_run_config(tiny_model_dir, NUM_STAGES, trust={"verify_fraction": 0.0})
    trust = offline_gate(config)  # its real verifier, over a directory with no replica
    group = produce_and_accept(trust, "flagged", served_by("replica-0", "sampler"))
    for _ in range(10):
        trust.flagged([group])
    queued, provenance, reason = trust.queue.get_nowait()
    assert (queued.group_id, reason) == ("flagged", "flagged")
    ruling = convene(trust.verifier, queued, provenance, repeat_pass=False)
    assert (ruling.verdict.outcome, ruling.verdict.detail) == ("skipped",
                                                               "no replica to re-execute on")
    trust.judge(ruling, provenance, reason)
    assert trust.count["verify_skipped"] == 1
    assert trust.reputation.counts("sampler") == {} and trust.reputation.counts("replica-0") == {}
    assert not trust.reputation.banned("sampler")


# ---- inference replicas are chosen by load and latency --------------------------------------

def test_inference_replicas_are_chosen_by_load_then_latency_never_by_claimed_capacity(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, NUM_STAGES)
    directory = Directory(cast(SwarmNode, OfflineNode()), config.name, NUM_STAGES, config.swarm)
    announce(directory, {"near": replica_record("near", 0, free_sessions=2),
                         "far": replica_record("far", 0, free_sessions=1000)})
    for _ in range(20):  # the calls' round trips, smoothed
        directory.observe("near", 0.02)
        directory.observe("far", 0.4)

    # Equally loaded (idle): the lower latency wins.
    assert directory.choose_inference(0) == "near"
    # Load is the sessions this process has open there, whatever room a replica claims: the one
    # that claims 1000 gets the next session, and then latency decides again.
    assert directory.choose_inference(0) == "far"
    assert directory.choose_inference(0) == "near"
    # "near" is full (2 of 2): only then does every later session go to "far", however slow.
    assert [directory.choose_inference(0) for _ in range(4)] == ["far"] * 4

    # Closed sessions free the room; with both idle, latency decides, as it changes.
    for peer in ["near"] * 2 + ["far"] * 5:
        directory.release(peer)
    for _ in range(20):
        directory.observe("far", 0.001)
    assert directory.choose_inference(0) == "far"


def test_a_replica_claiming_a_version_its_trainer_never_made_gets_no_preference(
        tiny_model_dir: Path) -> None:
    config = tiny_run_config(tiny_model_dir, NUM_STAGES)
    directory = Directory(cast(SwarmNode, OfflineNode()), config.name, NUM_STAGES, config.swarm)
    directory.version_ceiling = lambda stage: 5  # what the stage's trainer has made
    announce(directory, {"honest": msgspec.structs.replace(replica_record("honest", 0), version=5),
                         "boaster": msgspec.structs.replace(replica_record("boaster", 0),
                                                            version=10**6)})
    directory.observe("boaster", 0.001)  # and the lowest latency
    assert [directory.choose_inference(0) for _ in range(4)] == ["honest"] * 4
