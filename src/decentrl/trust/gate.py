"""The coordinator's trust gate: what it knows of who produced each rollout group, which groups it
spot-checks, what it does with rulings, flags and malformed messages, and whom it admits.

- Every group its sessions generate is recorded with its provenance (who computed what).
- A random `verify_fraction` of accepted groups is re-executed by other peers, and every group a
  peer on probation helped produce at `probation_verify_fraction` (trust/reputation.py). A group
  picked for a check does not train until its ruling (`awaiting_verdict`): whether a group is
  checked is decided here, from an unpredictable source, and never told to its producers. Groups
  the trainer's log-probs flagged are re-executed after their step, to find out who lied.
- A ruling is the tribunal's (trust/tribunal.py): no single verifier's opinion blames anyone,
  and no opinion of a peer on probation decides anything (a check only newcomers could weigh is
  counted as `verify_no_established`). Rulings, flags and malformed messages feed the
  reputation. A banned peer is never chosen again for the ban's length, and groups it helped
  produce that were not verified are dropped wherever they wait (inbox or pending buffer).
- What it remembers of groups is bounded (GROUPS_TRACKED), like the reputation
  it keeps, and text a peer chose is made inert before it is printed or logged.

A run stays live through a burst of new identities: their groups are checked, but only as fast as
the checks run (VERIFY_BACKLOG; a probation group that finds the backlog full is dropped, never
trained unchecked), and while established replicas have room, all newcomers of a stage together
get at most `probation_share` of its new sessions, from a budget that each ban of a newcomer of
the stage shrinks (net/probation.py), so established peers keep the run's generation going and a
liar renewing its key gets less each time. The budget's refusals are counted
(`probation_sessions_withheld`), as are the sessions refused to replicas the operator did not
admit (`replicas_not_admitted`) or past their address's limit (`probation_address_limited`)."""

from __future__ import annotations

import logging
import queue
import random
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from rich.console import Console

from decentrl.config import RunConfig
from decentrl.net.directory import Directory
from decentrl.net.node import SwarmNode
from decentrl.net.probation import ProbationBudget
from decentrl.net.text import peer_text
from decentrl.rollout.types import RolloutGroup
from decentrl.trust.provenance import Provenance
from decentrl.trust.reputation import Reputation
from decentrl.trust.tribunal import Ruling, convene
from decentrl.trust.verify import Verifier

log = logging.getLogger(__name__)

VERIFY_BACKLOG = 32
# Groups whose provenance or verdict is kept. Both matter only while a group waits to be trained,
# and at most a few hundred wait at once (generation in flight, the inbox, the pending buffer,
# the groups a rollback returns); a verdict that arrives after its group was trained is not
# needed at all. Past this the oldest are forgotten.
GROUPS_TRACKED = 4096

class RecentIds:
    """A set of ids that keeps only the newest `size` of them (adding one again renews it)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"RecentIds needs a size of at least 1, got {size}")
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, item: str) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class Trust:
    def __init__(self, config: RunConfig, node: SwarmNode, directory: Directory,
                 hidden_size: int, pad_id: int, console: Console | None = None,
                 vouched: Callable[[str], bool] = lambda peer: False,
                 admitted: Callable[[str], bool] = lambda peer: False,
                 stage_routing: Sequence[slice] = ()) -> None:
        """`vouched`, `admitted`: the peers the operator admitted, training peers and inference
        replicas (trust/reputation.py `Reputation`), asked afresh at each look.
        `stage_routing`: a mixture of experts' routing record, each stage's part (Verifier)."""
        self.config = config
        self.console = console or Console()
        self.reputation = Reputation(config.trust.ban_score, config.trust.ban_s,
                                     config.trust.probation_checks, vouched, admitted)
        self.reputation.on_ban.append(self._banned)
        directory.distrusted = self.reputation.banned
        directory.on_probation = self.reputation.on_probation
        directory.probation = ProbationBudget.of(config.trust)
        # Asked only with a per-address limit (the daemon is asked, at most every few seconds).
        directory.probation.hosts = lambda: node.peer_hosts()
        self.directory = directory
        self.reputation.on_ban.append(self._shrink_probation_budget)
        node.strikes_to_block, node.block_s = config.trust.strikes_to_block, config.trust.block_s
        node.on_strike = lambda peer, reason: self.reputation.record(peer, "malformed", reason)
        self.verifier = Verifier(node, directory, config, hidden_size, pad_id, stage_routing)
        self.lock = threading.Lock()
        self.provenance: OrderedDict[str, Provenance] = OrderedDict()
        self.verified = RecentIds(GROUPS_TRACKED)
        self.failed = RecentIds(GROUPS_TRACKED)
        self.awaiting: set[str] = set()  # groups picked for a check, held until their ruling
        self.unchecked = RecentIds(GROUPS_TRACKED)  # probation groups whose check could not run
        self.queue: queue.Queue[tuple[RolloutGroup, Provenance, str]] = \
            queue.Queue(maxsize=VERIFY_BACKLOG)
        # Unpredictable to peers: a peer that knew which groups get checked would lie elsewhere.
        self.random = random.Random(secrets.randbits(64))
        self.count: Counter[str] = Counter()
        # Groups trained per peer that helped produce them: what a liar got into training.
        self.trained_by: Counter[str] = Counter()

    # ---- what the coordinator tells the gate ----------------------------------------------

    def produced(self, group_id: str, provenance: Provenance) -> None:
        with self.lock:
            self.provenance[group_id] = provenance
            if len(self.provenance) > GROUPS_TRACKED:
                self.provenance.popitem(last=False)

    def forget(self, group_id: str) -> None:
        with self.lock:
            self.provenance.pop(group_id, None)

    def accepted(self, group: RolloutGroup) -> None:
        """An accepted group: maybe spot-check it (then it waits for its ruling)."""
        with self.lock:
            provenance = self.provenance.get(group.group_id)
        if provenance is None:
            return
        new = any(self.reputation.on_probation(p) for p in provenance.peers())
        trust = self.config.trust
        fraction = max(trust.verify_fraction, trust.probation_verify_fraction if new else 0.0)
        if self.random.random() >= fraction:
            return
        with self.lock:
            self.awaiting.add(group.group_id)
        if not self._enqueue(group, provenance, "probation" if new else "sampled"):
            with self.lock:
                self.awaiting.discard(group.group_id)
                if new:  # never trained unchecked; see the module docstring
                    self.unchecked.add(group.group_id)

    def awaiting_verdict(self, group_id: str) -> bool:
        """Whether the group waits for the ruling of its check (it must not train before)."""
        with self.lock:
            return group_id in self.awaiting

    def evaluated(self, group: RolloutGroup, provenance: Provenance) -> None:
        """A group an evaluation session made (shaped as a training group, so its replicas could
        not tell; or one greedy row, which they can): spot-checked at the same rate as training
        groups, under the sampling its session used (`Provenance.sampling`). A failed check counts
        against its replica as any other; the evaluation's result is not revised (the release
        comparison on this machine is the final word)."""
        if self.random.random() < self.config.trust.verify_fraction:
            self._enqueue(group, provenance, "evaluation")

    def trained(self, group_id: str) -> None:
        with self.lock:
            provenance = self.provenance.get(group_id)
            if provenance is not None:
                self.trained_by.update(provenance.peers())
                while len(self.trained_by) > GROUPS_TRACKED:  # bounded like the rest
                    del self.trained_by[min(self.trained_by, key=self.trained_by.__getitem__)]
        self.forget(group_id)  # a queued check holds its own reference

    def trained_from_banned(self) -> int:
        """Trained groups that a peer banned during the run helped produce (trained before its
        ban, unchecked or checked before it lied; the bans explained in `banned_peers`)."""
        with self.reputation.lock:
            banned = set(self.reputation.ban_causes)
        with self.lock:
            return sum(count for peer, count in self.trained_by.items() if peer in banned)

    def flagged(self, groups: list[RolloutGroup]) -> None:
        """Groups with rows the trainer's log-probs flagged (they did not count in the loss):
        re-execute them to find out who is responsible."""
        for group in {g.group_id: g for g in groups}.values():
            self.count["flagged"] += 1
            with self.lock:
                provenance = self.provenance.get(group.group_id)
            log.warning("group %s flagged by the trainer's log-probs", group.group_id)
            if provenance is not None:
                self._enqueue(group, provenance, "flagged")

    def distrusted_producer(self, group_id: str) -> str | None:
        """Why a group must be dropped (it failed a check, or a peer that helped produce it was
        banned and the group was not verified), or None."""
        with self.lock:
            if group_id in self.failed:
                return "failed verification"
            if group_id in self.unchecked:
                return "a peer on probation produced it and it could not be checked"
            if group_id in self.verified:
                return None
            provenance = self.provenance.get(group_id)
        if provenance is None:
            return None
        banned = [p for p in provenance.peers() if self.reputation.banned(p)]
        return f"produced with banned peers {[p[-8:] for p in banned]}" if banned else None

    def banned_peers(self) -> dict[str, str]:
        """The first peers banned during the run (reputation.BANS_EXPLAINED of them), each with
        the event that tipped it over the first time; `counters()` counts every ban."""
        with self.reputation.lock:
            return dict(self.reputation.ban_causes)

    def counters(self) -> dict[str, int]:
        probation = self.directory.probation.counts
        return {**{key: self.count[key] for key in (
            "verified", "verify_failed", "verify_unconfirmed", "verify_skipped", "verify_opinions",
            "verifiers_overruled", "verify_no_established", "flagged", "banned")},
            **{key: probation[key] for key in (
                "probation_sessions_withheld", "probation_address_limited",
                "replicas_not_admitted")}}

    # ---- spot-checks ---------------------------------------------------------------------

    def _enqueue(self, group: RolloutGroup, provenance: Provenance, reason: str) -> bool:
        try:
            self.queue.put_nowait((group, provenance, reason))
            return True
        except queue.Full:
            self.count["verify_skipped"] += 1  # checking lags generation: skip, never block
            return False

    def verify_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                group, provenance, reason = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                # A new identity's work always gets a second opinion: its partner could be
                # the one verifier drawn, and probation is where a covered lie would slip in.
                repeat = reason == "probation" or \
                    self.random.random() < self.config.trust.second_opinion_fraction
                ruling = convene(self.verifier, group, provenance, repeat,
                                 self.reputation.vouched)
            except Exception:  # noqa: BLE001 - one check lost; the thread goes on
                log.exception("verifying group %s failed", group.group_id)
                with self.lock:
                    self.awaiting.discard(group.group_id)
                continue
            self.judge(ruling, provenance, reason)

    def judge(self, ruling: Ruling, provenance: Provenance, reason: str) -> None:
        """Turn a ruling into reputation: every peer whose work checked out passed, the producer
        the ruling blamed failed, verifiers earn or lose by whether they were upheld. Nobody is
        charged for what nobody could check, nor for a failure nobody confirmed."""
        verdict = ruling.verdict
        self.count["verify_opinions"] += len(ruling.opinions)
        if ruling.lacked_established:
            # Never decided by newcomers: skipped, or its group dropped with nobody charged.
            self.count["verify_no_established"] += 1
        for judge, stage in set(ruling.upheld):
            self.reputation.record(judge, "passed", stage=stage, as_verifier=True)
        for overruled in ruling.overruled:
            self.count["verifiers_overruled"] += 1
            self.reputation.record(overruled.verifier, "failed", overruled.why, overruled.stage,
                                   as_verifier=True)
        if verdict.outcome == "skipped":
            self.count["verify_skipped"] += 1
            with self.lock:
                self.awaiting.discard(verdict.group_id)
                if reason == "probation":  # never trained unchecked
                    self.unchecked.add(verdict.group_id)
            log.info("check of group %s skipped: %s", verdict.group_id, peer_text(verdict.detail))
            return
        for stage in verdict.checked:
            if stage == verdict.stage:
                continue
            for peer in provenance.stage_peers(stage):
                self.reputation.record(peer, "passed", stage=stage)
        if verdict.outcome == "passed":
            self.count["verified"] += 1
            with self.lock:
                self.verified.add(verdict.group_id)
                self.awaiting.discard(verdict.group_id)
            return
        assert verdict.peer is not None
        self.count["verify_failed" if ruling.confirmed else "verify_unconfirmed"] += 1
        with self.lock:
            self.failed.add(verdict.group_id)
            self.awaiting.discard(verdict.group_id)
        confirmed = "" if ruling.confirmed else " (unconfirmed: nobody charged)"
        # The detail is the replica's own output: no markup, and made inert.
        self.console.print(f"group {verdict.group_id} failed its check{confirmed}: stage "
                           f"{verdict.stage} replica {verdict.peer[-8:]}: "
                           f"{peer_text(verdict.detail)}", style="red", markup=False,
                           highlight=False)
        if ruling.confirmed:
            self.reputation.record(verdict.peer, "failed", verdict.detail, verdict.stage)

    def _shrink_probation_budget(self, peer: str, seconds: float) -> None:
        """A peer banned while on probation makes its stage's newcomers wait longer: the next
        key of the same liar is one of them."""
        if self.reputation.on_probation(peer):
            self.directory.probation_banned(peer)

    def _banned(self, peer: str, seconds: float) -> None:
        self.count["banned"] += 1
        self.console.print(f"[red]peer {peer[-8:]} banned for {seconds:.0f}s (score "
                           f"{self.reputation.score(peer):.2f})[/]")
