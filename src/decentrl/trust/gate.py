"""The coordinator's trust gate: what it knows of who produced each rollout group, which groups it
spot-checks, what it does with verdicts, flags and malformed messages, and whom it admits.

- Every group its sessions generate is recorded with its provenance (who computed what).
- A random `verify_fraction` of accepted groups is re-executed on other replicas (trust/verify.py),
  off the training path; groups the trainer's log-probs flagged are re-executed too, to find out
  who is responsible. Peers cannot tell which groups will be checked.
- Verdicts, flags and malformed messages feed the reputation (trust/reputation.py). A banned peer
  is never chosen again for the ban's length, and groups it helped produce that were not verified
  are dropped wherever they wait (inbox or pending buffer).
- A group submitted by another peer is admitted only for a problem leased to that peer; this
  coordinator generates its own groups and leases none, so a remote submission is refused (a
  replay of a group already accepted is named as such).
- What it remembers of groups is bounded (GROUPS_TRACKED, ACCEPTED_IDS_KEPT), like the reputation
  it keeps, and text a peer chose is made inert before it is printed or logged."""

from __future__ import annotations

import logging
import queue
import random
import secrets
import threading
from collections import Counter, OrderedDict

from rich.console import Console

from decentrl.config import RunConfig
from decentrl.net.directory import Directory
from decentrl.net.node import SwarmNode
from decentrl.net.text import SHOWN_ID_CHARS, peer_text
from decentrl.rollout.types import RolloutGroup
from decentrl.trust.provenance import Provenance
from decentrl.trust.reputation import Reputation
from decentrl.trust.verify import Verdict, Verifier

log = logging.getLogger(__name__)

VERIFY_BACKLOG = 32
# Groups whose provenance or verdict is kept. Both matter only while a group waits to be trained,
# and at most a few hundred wait at once (generation in flight, the inbox, the pending buffer,
# the groups a rollback returns); a verdict that arrives after its group was trained is not
# needed at all. Past this the oldest are forgotten.
GROUPS_TRACKED = 4096
# Accepted group ids, kept only to name a replayed submission as such: a replay of an older group
# is refused all the same (its problem is leased to nobody), only named less precisely.
ACCEPTED_IDS_KEPT = 16384


class SubmissionRefused(ValueError):
    """A rollout submission this coordinator does not admit; the message says why."""


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
                 hidden_size: int, pad_id: int, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.reputation = Reputation(config.trust.ban_score, config.trust.ban_s)
        self.reputation.on_ban.append(self._banned)
        directory.distrusted = self.reputation.banned
        node.strikes_to_block, node.block_s = config.trust.strikes_to_block, config.trust.block_s
        node.on_strike = lambda peer, reason: self.reputation.record(peer, "malformed", reason)
        self.verifier = Verifier(node, directory, config, hidden_size, pad_id)
        self.lock = threading.Lock()
        self.provenance: OrderedDict[str, Provenance] = OrderedDict()
        self.accepted_ids = RecentIds(ACCEPTED_IDS_KEPT)
        self.verified = RecentIds(GROUPS_TRACKED)
        self.failed = RecentIds(GROUPS_TRACKED)
        self.queue: queue.Queue[tuple[RolloutGroup, Provenance, str]] = \
            queue.Queue(maxsize=VERIFY_BACKLOG)
        # Unpredictable to peers: a peer that knew which groups get checked would lie elsewhere.
        self.random = random.Random(secrets.randbits(64))
        self.count: Counter[str] = Counter()

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
        """An accepted group: maybe spot-check it."""
        with self.lock:
            self.accepted_ids.add(group.group_id)
            provenance = self.provenance.get(group.group_id)
        if provenance is not None and self.random.random() < self.config.trust.verify_fraction:
            self._enqueue(group, provenance, "sampled")

    def evaluated(self, group: RolloutGroup, provenance: Provenance) -> None:
        """A group an evaluation session made (shaped as a training group, so its replicas could
        not tell): spot-checked at the same rate as training groups. A failed check counts
        against its replica as any other; the evaluation's result is not revised (the release
        comparison on this machine is the final word)."""
        if self.random.random() < self.config.trust.verify_fraction:
            self._enqueue(group, provenance, "evaluation")

    def trained(self, group_id: str) -> None:
        self.forget(group_id)  # a queued check holds its own reference

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
            if group_id in self.verified:
                return None
            provenance = self.provenance.get(group_id)
        if provenance is None:
            return None
        banned = [p for p in provenance.peers() if self.reputation.banned(p)]
        return f"produced with banned peers {[p[-8:] for p in banned]}" if banned else None

    def admit_submission(self, group: RolloutGroup, sender: str) -> None:
        """A group another peer submitted: raise SubmissionRefused unless it may enter."""
        if self.reputation.banned(sender):
            raise SubmissionRefused(f"peer {sender[-8:]} is banned")
        with self.lock:
            replay = group.group_id in self.accepted_ids
        self.count["submissions_refused"] += 1
        if replay:
            detail = f"replayed group {peer_text(group.group_id, SHOWN_ID_CHARS)}, already accepted"
        else:
            detail = f"problem {group.problem_index} is not leased to peer {sender[-8:]}"
        self.reputation.record(sender, "failed", detail)
        raise SubmissionRefused(detail)

    def banned_peers(self) -> dict[str, str]:
        """The first peers banned during the run (reputation.BANS_EXPLAINED of them), each with
        the event that tipped it over the first time; `counters()` counts every ban."""
        with self.reputation.lock:
            return dict(self.reputation.ban_causes)

    def counters(self) -> dict[str, int]:
        return {key: self.count[key] for key in ("verified", "verify_failed", "verify_skipped",
                                                 "flagged", "banned", "submissions_refused")}

    # ---- spot-checks ---------------------------------------------------------------------

    def _enqueue(self, group: RolloutGroup, provenance: Provenance, reason: str) -> None:
        try:
            self.queue.put_nowait((group, provenance, reason))
        except queue.Full:
            self.count["verify_skipped"] += 1  # checking lags generation: skip, never block

    def verify_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                group, provenance, reason = self.queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                verdict = self.verifier.verify(group, provenance)
            except Exception:  # noqa: BLE001 - one check lost; the thread goes on
                log.exception("verifying group %s failed", group.group_id)
                continue
            self.judge(verdict, provenance, reason)

    def judge(self, verdict: Verdict, provenance: Provenance, reason: str) -> None:
        """Turn a verdict into reputation: every peer whose work checked out passed; the blamed
        one failed. A flagged group that could not be checked counts as a flag against the
        replicas that sampled it."""
        if verdict.outcome == "skipped":
            self.count["verify_skipped"] += 1
            log.info("check of group %s skipped: %s", verdict.group_id, peer_text(verdict.detail))
            if reason == "flagged":
                for peer in provenance.stage_peers(len(provenance.stages) - 1):
                    self.reputation.record(peer, "flagged", "flagged by the trainer, "
                                           "unverifiable", len(provenance.stages) - 1)
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
            return
        assert verdict.peer is not None
        self.count["verify_failed"] += 1
        with self.lock:
            self.failed.add(verdict.group_id)
        # The detail is the replica's own output: no markup, and made inert.
        self.console.print(f"group {verdict.group_id} failed its check: stage {verdict.stage} "
                           f"replica {verdict.peer[-8:]}: {peer_text(verdict.detail)}",
                           style="red", markup=False, highlight=False)
        self.reputation.record(verdict.peer, "failed", verdict.detail, verdict.stage)

    def _banned(self, peer: str, seconds: float) -> None:
        self.count["banned"] += 1
        self.console.print(f"[red]peer {peer[-8:]} banned for {seconds:.0f}s (score "
                           f"{self.reputation.score(peer):.2f})[/]")
