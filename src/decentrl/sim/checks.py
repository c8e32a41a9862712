"""Simulated trust work: spot checks and training audits, and what they catch.

A finished group is picked for a spot check with probability `trust.verify_fraction`
(trust/gate.py `Trust.accepted`) and held until its ruling, as the real pool holds it. The check
re-executes the group at one replica per stage that did not produce it (trust/verify.py
`Verifier.panel`): a teacher-forced prefill of every row, its inputs and outputs through the
coordinator as in the generation data plane. A group of an adversary fails: the adversary is
banned (it leaves the swarm), its group is dropped, and so are its groups still pending. A step
is audited with probability `trust.train_audit_fraction` where a stage has a second training
peer (trust/audit.py): that peer recomputes the stage's forward and backward of the step."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from decentrl.sim.peers import PeerGone, Replica, TrainingPeer
from decentrl.sim.world import Group, World


class Checks:
    def __init__(self, world: World, accept: Callable[[Group], None]) -> None:
        self.world, self.accept = world, accept
        self.adversaries = {p.name for p in world.scenario.peers if p.adversary}
        self.pending = 0  # groups held for their ruling

    def produced(self, group: Group) -> None:
        """A group taken from the inbox: checked (held until its ruling), or accepted straight
        away (trust/gate.py `Trust.accepted`)."""
        world = self.world
        if group.producers & world.banned:
            world.tally.groups["dropped: producer banned"] += 1
            return
        if world.random.random() < world.config.trust.verify_fraction:
            world.env.process(self._check(group))
            return
        if group.producers & self.adversaries:
            world.tally.groups["trained unchecked from an adversary"] += 1
        self.accept(group)

    def _check(self, group: Group) -> Generator[Any, Any, None]:
        self.pending += 1
        try:
            yield from self._rule(group)
        finally:
            self.pending -= 1

    def _rule(self, group: Group) -> Generator[Any, Any, None]:
        world = self.world
        world.tally.spot_checks += 1
        tokens = group.rows * (group.prompt_tokens + max(group.completion_tokens))
        try:
            for stage in range(world.config.num_stages):
                verifier = self._verifier(stage, group.producers)
                if verifier is None:
                    continue
                costs = verifier.costs
                yield from world.network.send(world.coordinator, verifier.endpoint,
                                              costs.input_bytes(tokens))
                yield verifier.step(group.rows, tokens // group.rows, 0, purpose="verify")
                out = costs.output_bytes(group.rows if costs.last else tokens)
                yield from world.network.send(verifier.endpoint, world.coordinator, out)
                yield from world.coordinator_work(1, out)
        except PeerGone:  # no ruling: the group trains unjudged, as a skipped check's does
            world.tally.groups["check skipped: verifier left"] += 1
            if group.producers & self.adversaries:
                world.tally.groups["trained unchecked from an adversary"] += 1
            self.accept(group)
            return
        liars = group.producers & self.adversaries
        if not liars:
            self.accept(group)
            return
        world.tally.groups["dropped: failed its spot check"] += 1
        for name in liars - world.banned:
            world.ban(name)

    def _verifier(self, stage: int, producers: frozenset[str]) -> Replica | None:
        world = self.world
        others = [r for r in world.live_replicas(stage) if r.name not in producers]
        return world.random.choice(others) if others else None

    def audit(self, micro_batches: list[tuple[int, int]]) -> None:
        """Maybe audit a finished step: each stage's second training peer recomputes it."""
        world = self.world
        if world.random.random() >= world.config.trust.train_audit_fraction:
            return
        for stage in range(world.config.num_stages):
            auditors = [t for t in world.trainers[stage] if t.alive][1:]
            if auditors:
                world.env.process(self._audit(auditors[0], micro_batches))

    def _audit(self, auditor: TrainingPeer, micro_batches: list[tuple[int, int]]
               ) -> Generator[Any, Any, None]:
        try:
            for tokens, rows in micro_batches:
                yield from auditor.forward(tokens, rows, "audit")
                yield from auditor.backward(tokens, rows, "audit")
        except PeerGone:
            return
