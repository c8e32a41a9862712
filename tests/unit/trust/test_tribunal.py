"""Judges are judged (trust/tribunal.py, trust/gate.py, trust/reputation.py), with no network: the
coordinator's gate over a directory filled by hand, its real panel draws, and re-executions
answered by a scripted court in which each verifier answers as its character says.

- No single verifier blames anyone: a framer is overruled and charged, a verifier covering its
  partner is caught when its pass is repeated, a failure nobody else can confirm charges nobody.
- Verifiers are drawn at random among the eligible, never the group's producers, never a peer on
  probation while an established one exists, whatever they announce.
- A new identity is checked at a high rate and is banned at its first confirmed lie; an admitted
  peer starts with a record.
- Newcomers never decide (issue 32): two new identities lying as verifiers against an established
  replica and an admitted training peer charge nobody; where only newcomers could judge, the
  check is skipped or its group dropped, counted, never decided; a newcomer's pass clears nobody;
  a newcomer's failure makes the tribunal ask established verifiers, who may charge it.
- Verdict before influence: a group picked for a check does not train before its ruling."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Literal

from rich.console import Console
from swarm_helpers import tiny_run_config

from decentrl.config import RunConfig
from decentrl.coordinator.backend import TrustEveryone
from decentrl.coordinator.local_backend import local_run
from decentrl.rollout.types import RolloutGroup
from decentrl.trust.gate import Trust
from decentrl.trust.provenance import Provenance
from decentrl.trust.tribunal import convene
from decentrl.trust.verify import Verdict, Verifier
from tests.unit.trust.test_trust_claims import (
    NUM_STAGES,
    announce,
    made_up_group,
    offline_gate,
    replica_record,
    served_by,
)

Character = Literal["honest", "framer", "coverer", "gone", "restarting"]


class Court(Verifier):
    """Re-execution as each verifier would answer it: an honest one finds exactly the `liars`'
    lies, a framer fails every group at its stage, a coverer passes every group, and a panel
    with a gone verifier cannot re-execute (nor one with a restarting verifier, the first time:
    then it answers as an honest one)."""

    def __init__(self, trust: Trust, characters: dict[str, Character], liars: set[str]) -> None:
        super().__init__(trust.verifier.node, trust.verifier.directory, trust.config, 32, 0)
        self.characters, self.liars = characters, liars
        self.panels: list[tuple[str, ...]] = []
        self.restarted: set[str] = set()

    def verify(self, group: RolloutGroup, provenance: Provenance,
               panel: tuple[str, ...]) -> Verdict:
        self.panels.append(panel)
        stages = tuple(range(NUM_STAGES))
        restarting = {judge for judge in panel if self.characters.get(judge) == "restarting"}
        if any(self.characters.get(judge) == "gone" for judge in panel) \
                or restarting - self.restarted:
            self.restarted |= restarting
            return Verdict(group.group_id, "skipped", None, None,
                           "re-execution failed: verify_step: Connect failed", (), 0.0, panel)
        # A producer re-executing its own stage feeds the next one and judges nothing.
        judged = tuple(s for s in stages if panel[s] not in provenance.stage_peers(s))
        for stage in judged:
            character = self.characters.get(panel[stage], "honest")
            lie = any(p in self.liars for p in provenance.stage_peers(stage))
            if character == "framer" or (character == "honest" and lie):
                culprit = provenance.stages[stage].peer_at(0)
                return Verdict(group.group_id, "failed", stage, culprit, "does not re-execute",
                               tuple(s for s in judged if s <= stage), 0.0, panel)
        return Verdict(group.group_id, "passed", None, None, "", judged, 0.0, panel)


def court_gate(config: RunConfig, replicas: dict[str, int], characters: dict[str, Character],
               liars: set[str]) -> tuple[Trust, Court]:
    trust = offline_gate(config)
    announce(trust.verifier.directory,
             {name: replica_record(name, stage) for name, stage in replicas.items()})
    court = Court(trust, characters, liars)
    trust.verifier = court
    return trust, court


def config_for(tiny_model_dir: Path, **trust: object) -> RunConfig:
    return tiny_run_config(tiny_model_dir, NUM_STAGES, trust={"verify_fraction": 0.0, **trust})


# Stage 0 is served by "p0"; stage 1 by "p1" (the producer) and three others that may verify.
REPLICAS = {"p0": 0, "v0a": 0, "v0b": 0, "p1": 1, "v1a": 1, "v1b": 1, "v1c": 1}


def test_a_framing_verifier_is_overruled_and_charged_and_the_honest_producer_is_not(
        tiny_model_dir: Path) -> None:
    trust, court = court_gate(config_for(tiny_model_dir), REPLICAS, {"v1a": "framer"}, set())
    framed = 0
    for number in range(40):
        provenance = served_by("p0", "p1")
        ruling = convene(court, made_up_group(f"g{number}"), provenance, repeat_pass=False)
        trust.judge(ruling, provenance, "sampled")
        assert ruling.verdict.outcome == "passed", ruling
        if any(panel[1] == "v1a" for panel in court.panels[-len(ruling.opinions):]):
            framed += 1
            assert len(ruling.opinions) == 3  # the framer, a disagreeing second, a decider
            assert [o.verifier for o in ruling.overruled] == ["v1a"]
    assert framed > 0  # drawn at random among three: 40 draws never missing it is ~1e-7
    assert trust.reputation.counts("p1").get("failed", 0) == 0
    assert trust.reputation.counts("v1a")["failed"] == framed
    assert trust.reputation.banned("v1a") and not trust.reputation.banned("p1")


def test_a_verifier_covering_its_partner_is_caught_when_its_pass_is_repeated(
        tiny_model_dir: Path) -> None:
    trust, court = court_gate(config_for(tiny_model_dir), REPLICAS, {"v1a": "coverer"}, {"p1"})
    provenance = served_by("p0", "p1")
    covered = caught = 0
    for number in range(30):
        ruling = convene(court, made_up_group(f"g{number}"), provenance, repeat_pass=True)
        trust.judge(ruling, provenance, "sampled")
        # Whoever the first panel was, the liar's groups never pass.
        assert ruling.verdict.outcome == "failed" and ruling.confirmed, ruling
        assert ruling.verdict.peer == "p1"
        if any(o.verifier == "v1a" for o in ruling.overruled):
            covered += 1
        caught += 1
    assert covered > 0 and trust.reputation.counts("v1a")["failed"] == covered
    assert trust.reputation.banned("p1")


def test_a_verifier_that_does_not_answer_is_replaced_by_another_draw(
        tiny_model_dir: Path) -> None:
    trust, court = court_gate(config_for(tiny_model_dir), REPLICAS, {"v1a": "gone"}, {"p1"})
    provenance = served_by("p0", "p1")
    drawn = 0
    for number in range(30):
        ruling = convene(court, made_up_group(f"g{number}"), provenance, repeat_pass=False)
        assert ruling.verdict.outcome == "failed" and ruling.verdict.peer == "p1", ruling
        drawn += any(panel[1] == "v1a" for panel in court.panels)
        court.panels.clear()
    assert drawn > 0  # drawn at random among three: 30 draws never missing it is ~5e-6


def test_a_failure_no_second_verifier_can_confirm_charges_nobody_and_drops_the_group(
        tiny_model_dir: Path) -> None:
    # Stage 1 has one verifier besides its producer: nobody can confirm what it reports.
    replicas = {"p0": 0, "v0a": 0, "p1": 1, "v1a": 1}
    trust, court = court_gate(config_for(tiny_model_dir), replicas, {"v1a": "framer"}, set())
    provenance = served_by("p0", "p1")
    trust.produced("g", provenance)
    ruling = convene(court, made_up_group("g"), provenance, repeat_pass=False)
    trust.judge(ruling, provenance, "sampled")
    assert ruling.verdict.outcome == "failed" and not ruling.confirmed
    assert trust.count["verify_unconfirmed"] == 1 and trust.count["verify_failed"] == 0
    assert trust.reputation.counts("p1") == {} and trust.reputation.counts("v1a") == {}
    assert trust.distrusted_producer("g") == "failed verification"


def test_verifiers_are_drawn_at_random_never_producers_never_new_while_established_exist(
        tiny_model_dir: Path) -> None:
    config = config_for(tiny_model_dir, probation_checks=2)
    trust, court = court_gate(config, {**REPLICAS, "newcomer": 1}, {}, set())
    for peer in ("v1a", "v1b", "v1c", "v0a", "v0b"):
        for _ in range(2):
            trust.reputation.record(peer, "passed")
    verifier = Verifier(court.node, court.directory, config, 32, 0)
    drawn = Counter()
    for _ in range(600):
        panel = verifier.panel(served_by("p0", "p1"))
        assert panel is not None
        drawn.update(panel)
    assert set(drawn) == {"v0a", "v0b", "v1a", "v1b", "v1c"}  # not p0, p1, nor the newcomer
    for peer in ("v1a", "v1b", "v1c"):
        assert 150 < drawn[peer] < 250, drawn  # uniform: 200 each
    # With nobody established at a stage, a newcomer is drawn: its opinion is advisory (it may
    # make the tribunal ask an established verifier; trust/tribunal.py).
    for peer in ("v1a", "v1b", "v1c"):
        trust.reputation.record(peer, "proved")  # banned
    panel = verifier.panel(served_by("p0", "p1"))
    assert panel is not None and panel[1] == "newcomer"


def test_a_new_identity_is_checked_held_and_banned_at_its_first_lie(tiny_model_dir: Path
                                                                    ) -> None:
    config = config_for(tiny_model_dir, probation_checks=2, probation_verify_fraction=1.0)
    trust, court = court_gate(config, REPLICAS, {}, {"p1"})
    trust.reputation.vouched = lambda peer: peer == "p0"  # an admitted peer has a record
    for peer in ("v0a", "v0b", "v1a", "v1b", "v1c"):
        for _ in range(2):
            trust.reputation.record(peer, "passed")
    assert not trust.reputation.on_probation("p0") and trust.reputation.on_probation("p1")
    provenance = served_by("p0", "p1")
    trust.produced("first", provenance)
    trust.accepted(made_up_group("first"))  # verify_fraction is 0: probation alone checks it
    assert trust.awaiting_verdict("first")
    group, queued, reason = trust.queue.get_nowait()
    assert (group.group_id, reason) == ("first", "probation")
    trust.judge(convene(court, group, queued, repeat_pass=False), queued, reason)
    assert not trust.awaiting_verdict("first")
    assert trust.reputation.banned("p1")  # score 1/2 is not under 0.5: probation banned it
    assert trust.reputation.counts("p1") == {"failed": 1}


def test_a_probation_group_that_cannot_be_checked_never_trains(tiny_model_dir: Path) -> None:
    config = config_for(tiny_model_dir, probation_checks=2)
    trust = offline_gate(config)  # no verifier at all
    provenance = served_by("new0", "new1")
    trust.produced("g", provenance)
    trust.accepted(made_up_group("g"))
    group, queued, reason = trust.queue.get_nowait()
    trust.judge(convene(trust.verifier, group, queued, repeat_pass=False), queued, reason)
    assert trust.distrusted_producer("g") == ("a peer on probation produced it and it could "
                                              "not be checked")
    assert trust.reputation.counts("new1") == {}


class HoldingGate(TrustEveryone):
    """Holds every group until `release` is set; records what trained."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held: set[str] = set()
        self.trained_ids: list[str] = []

    def awaiting_verdict(self, group_id: str) -> bool:
        if self.release.is_set():
            return False
        self.held.add(group_id)
        return True

    def trained(self, group_id: str) -> None:
        self.trained_ids.append(group_id)


def test_a_group_waiting_for_its_ruling_does_not_train(tiny_model_dir: Path,
                                                       tmp_path: Path) -> None:
    config = tiny_run_config(
        tiny_model_dir, NUM_STAGES, host={"run_dir": str(tmp_path), "threads": 1},
        rollout={"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
        train={"mode": "async", "steps": 1, "micro_batch_size": 4,
               "zero_variance_groups": "keep"})
    gate = HoldingGate()
    loop = local_run(config, Console(quiet=True), gate=gate)
    try:
        for _ in range(2):  # ingestion without the generation threads: groups made by hand
            loop.backend.generation.transport.put_rollouts(loop.generation.generate(1)[0], 1.0)
        collected: list[object] = []
        collector = threading.Thread(target=lambda: collected.extend(loop.collect(2)))
        collector.start()
        collector.join(timeout=3)
        assert collector.is_alive() and not collected  # both held
        assert len(loop.pool.held) == 2 and len(gate.held) == 2
        gate.release.set()
        collector.join(timeout=30)
        assert not collector.is_alive()
        assert {s.group.group_id for s, _ in collected} == gate.held  # type: ignore[attr-defined]
    finally:
        loop.stop.set()
        loop.close()


def test_an_admitted_training_peer_judges_a_stage_nobody_else_can(tiny_model_dir: Path) -> None:
    # Stage 1: one replica and its training peer (admitted, vouched). Its opinion confirms a lie
    # alone; a stranger's framing opinion loses to it.
    replicas = {"p0": 0, "v0a": 0, "p1": 1, "trainer1": 1}
    trust, court = court_gate(config_for(tiny_model_dir), replicas, {}, {"p1"})
    trust.reputation.vouched = lambda peer: peer == "trainer1"
    provenance = served_by("p0", "p1")
    ruling = convene(court, made_up_group("lie"), provenance, False, trust.reputation.vouched)
    assert ruling.confirmed and ruling.verdict.peer == "p1"
    trust.judge(ruling, provenance, "sampled")
    assert trust.reputation.counts("p1") == {"failed": 1}

    replicas = {"p0": 0, "v0a": 0, "p1": 1, "framer": 1, "trainer1": 1}
    trust, court = court_gate(config_for(tiny_model_dir), replicas, {"framer": "framer"}, set())
    vouched = lambda peer: peer == "trainer1"  # noqa: E731
    outcomes = Counter()
    for number in range(20):
        ruling = convene(court, made_up_group(f"g{number}"), provenance, True, vouched)
        trust.judge(ruling, provenance, "sampled")
        outcomes[ruling.verdict.outcome] += 1
    assert outcomes == {"passed": 20}
    assert trust.reputation.counts("p1").get("failed", 0) == 0
    assert trust.reputation.counts("framer")["failed"] > 0


def test_what_a_banned_liar_got_into_training_is_counted(tiny_model_dir: Path) -> None:
    config = config_for(tiny_model_dir)
    trust = offline_gate(config)
    for number in range(3):
        trust.produced(f"g{number}", served_by("p0", "liar" if number < 2 else "p1"))
        trust.trained(f"g{number}")
    assert trust.trained_from_banned() == 0
    trust.reputation.record("liar", "proved", "a lie")  # banned, later
    assert trust.trained_from_banned() == 2


def establish(trust: Trust, *peers: str) -> None:
    """Give `peers` the record that ends their probation (config_for's probation_checks = 2)."""
    for peer in peers:
        for _ in range(2):
            trust.reputation.record(peer, "passed")


# The issue's attack (#32): stage 1's honest replica p1 (established) is judged by its admitted
# training peer; two new identities join as stage-1 verifiers and lie in every opinion they give.
FRAMED = {"p0": 0, "v0a": 0, "p1": 1, "trainer1": 1, "framer1": 1, "framer2": 1}
FRAMERS: dict[str, Character] = {"framer1": "framer", "framer2": "framer"}


def test_newcomers_framing_an_established_replica_and_an_admitted_peer_charge_nobody(
        tiny_model_dir: Path) -> None:
    # Before: the admitted peer's pass was repeated by one framer (the others were used up), a
    # disagreement the second framer decided: p1 charged, the admitted peer overruled.
    trust, court = court_gate(config_for(tiny_model_dir, probation_checks=2), FRAMED, FRAMERS,
                              set())
    trust.reputation.vouched = lambda peer: peer == "trainer1"
    establish(trust, "p0", "v0a", "p1")
    assert trust.reputation.on_probation("framer1") and trust.reputation.on_probation("framer2")
    provenance = served_by("p0", "p1")
    for number in range(20):
        ruling = convene(court, made_up_group(f"g{number}"), provenance, True,
                         trust.reputation.vouched)
        trust.judge(ruling, provenance, "sampled")
        assert ruling.verdict.outcome == "passed" and ruling.confirmed, ruling
    # A second opinion comes from established verifiers only: the framers were never asked.
    assert {panel[1] for panel in court.panels} == {"trainer1"}
    for honest in ("p1", "trainer1"):
        assert trust.reputation.counts(honest).get("failed", 0) == 0
        assert not trust.reputation.banned(honest)
    assert trust.count["verifiers_overruled"] == 0 and trust.count["verify_failed"] == 0


def test_where_only_newcomers_are_left_the_check_is_skipped_and_counted_never_decided(
        tiny_model_dir: Path) -> None:
    # The admitted peer is gone: only the framers could judge stage 1.
    replicas = {peer: stage for peer, stage in FRAMED.items() if peer != "trainer1"}
    trust, court = court_gate(config_for(tiny_model_dir, probation_checks=2), replicas, FRAMERS,
                              set())
    establish(trust, "p0", "v0a", "p1")
    provenance = served_by("p0", "p1")
    for number in range(10):
        trust.produced(f"g{number}", provenance)
        ruling = convene(court, made_up_group(f"g{number}"), provenance, True)
        trust.judge(ruling, provenance, "sampled")
        # Their failure asked for an established verifier, there was none: dropped, unconfirmed.
        assert ruling.lacked_established and not ruling.confirmed, ruling
        assert ruling.overruled == () and ruling.upheld == ()
        assert trust.distrusted_producer(f"g{number}") == "failed verification"
    assert trust.count["verify_no_established"] == 10
    assert trust.counters()["verify_no_established"] == 10
    assert trust.count["verify_failed"] == 0 and trust.count["verifiers_overruled"] == 0
    assert trust.reputation.counts("p1") == {"passed": 2}  # its record, nothing since
    assert not trust.reputation.banned("p1")


def test_a_newcomers_pass_clears_nobody_and_earns_no_producer_a_record(
        tiny_model_dir: Path) -> None:
    # Two new identities: one serves stage 1, the other is the only one that can judge it.
    replicas = {"p0": 0, "v0a": 0, "new1": 1, "partner": 1}
    trust, court = court_gate(config_for(tiny_model_dir, probation_checks=2), replicas,
                              {"partner": "coverer"}, {"new1"})
    establish(trust, "p0", "v0a")
    provenance = served_by("p0", "new1")
    for number in range(5):
        trust.produced(f"g{number}", provenance)
        ruling = convene(court, made_up_group(f"g{number}"), provenance, True)
        trust.judge(ruling, provenance, "probation")
        assert ruling.verdict.outcome == "skipped" and ruling.lacked_established, ruling
        assert trust.distrusted_producer(f"g{number}") == ("a peer on probation produced it and "
                                                           "it could not be checked")
    assert trust.reputation.on_probation("new1")  # the partner's passes earned it nothing
    assert trust.reputation.counts("new1") == {}
    assert trust.count["verify_no_established"] == 5 and trust.count["verified"] == 0


def test_a_newcomers_failure_is_weighed_by_established_verifiers_and_charges_it_if_wrong(
        tiny_model_dir: Path) -> None:
    # Stage 1's one established verifier does not answer the first draw; the redraw can only
    # give a newcomer, a framer. Its failure makes the tribunal ask established verifiers (the
    # restarted one answers now): two of their passes overrule it.
    replicas = {"p0": 0, "v0a": 0, "p1": 1, "v1a": 1, "framer": 1}
    trust, court = court_gate(config_for(tiny_model_dir, probation_checks=2), replicas,
                              {"framer": "framer", "v1a": "restarting"}, set())
    establish(trust, "p0", "v0a", "p1", "v1a")
    provenance = served_by("p0", "p1")
    ruling = convene(court, made_up_group("g"), provenance, False)
    trust.judge(ruling, provenance, "sampled")
    assert [panel[1] for panel in court.panels] == ["v1a", "framer", "v1a", "v1a"]
    assert ruling.verdict.outcome == "passed" and ruling.confirmed, ruling
    # Upheld by two established opinions: the newcomer is charged, and on probation that bans it.
    assert [o.verifier for o in ruling.overruled] == ["framer"]
    assert trust.reputation.banned("framer")
    assert trust.reputation.counts("p1").get("failed", 0) == 0
    assert not trust.reputation.banned("p1") and not trust.reputation.banned("v1a")


def test_an_opinion_a_newcomer_fed_is_weighed_again_with_established_peers_feeding(
        tiny_model_dir: Path) -> None:
    # Stage 0's only verifier besides its producer is a newcomer: the first panel's opinion on
    # the liar at stage 1 is advisory (the newcomer fed its judge). The tribunal asks again with
    # the established producer feeding stage 0: two established opinions confirm the lie.
    replicas = {"p0": 0, "n0": 0, "p1": 1, "v1a": 1, "v1b": 1}
    trust, court = court_gate(config_for(tiny_model_dir, probation_checks=2), replicas, {},
                              {"p1"})
    establish(trust, "p0", "p1", "v1a", "v1b")
    provenance = served_by("p0", "p1")
    ruling = convene(court, made_up_group("g"), provenance, False)
    trust.judge(ruling, provenance, "sampled")
    assert [panel[0] for panel in court.panels] == ["n0", "p0", "p0"]
    assert {panel[1] for panel in court.panels[1:]} == {"v1a", "v1b"}
    assert ruling.confirmed and ruling.verdict.peer == "p1" and not ruling.lacked_established
    assert not trust.reputation.banned("p1")  # established: one confirmed lie, score 3/4
    assert trust.reputation.counts("p1")["failed"] == 1
    assert ruling.overruled == ()
