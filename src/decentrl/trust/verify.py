"""Spot-checks: re-execute a rollout group on other replicas and name the peer that lied.

The group's session is rebuilt column by column exactly as generation laid it out (left-padded
prompts, then one column per decoding step), and fed teacher-forced through one replica per stage
that did not serve the original, in segments: each segment covers the decoding steps one span of
`version_spans` recorded, and every verifier rewinds its weights to the version that span names
(sync/history.py). That is a prefill, far cheaper than generating. Where the session replayed
a stage from position 0 (a failover, or a retry after a timeout), the replica recomputed every
earlier column with its weights of the moment, the version that step recorded, not those of the
earlier steps: the verifier of that stage replays from position 0 at the same column too, at
that version (`StageProvenance.rebuilt`), so the re-execution is the computation the rollout got.

A session of several groups is checked a group at a time: the group's rows alone, in the
session's columns (left-padded to the session's prompt columns, so every column the provenance
names is the same one), against the sketches of those rows (trust/provenance.py `group_shares`);
the last stage draws the seeded noise of the session's rows and scores the group's
(`Provenance.first_row`). A row attends to its own keys only, so its hidden states depend on the
other rows of its batch by rounding alone, which the tolerances cover as they cover a peer's
batching of many sessions into one forward.

What is compared:
- every stage but the last: the coordinator's secret sketches of the hidden states the original
  replicas delivered, against the same sketches of the verifier's, at every (row, position)
  (trust/commit.py);
- the last stage: each sampled completion token's claimed behaviour log-prob against the
  re-executed one, and its seeded sampling margin (0 when the token is what the seeded draw gives;
  a token that was not drawn, such as a random or injected one, has a large margin), both under
  the sampling the session asked for (`Provenance.sampling`: an evaluation's greedy session is
  judged greedy, its margin the top log-prob minus the token's). Tokens an
  environment forced into a multi-turn episode are fed but not judged here (nothing sampled them).
- a stage with mixture-of-experts layers, where the rollouts recorded their routing (the learner
  replays it): each claimed token's routing gap in the re-execution (model/moe.py
  `routing_gaps`, nats), judged like the last stage's tokens (`judge_routing`), so a replica
  whose activations were honest but whose claimed experts were not fails too.

Blame: among the stages whose sketches fail, the one with the earliest failing position (ties:
the lower stage), at the replica that served that column. A lie at stage s at position q fails
stage s at q, and stage s+1 (fed the lie, re-executed on the truth) only at q and later (causal
attention): the liar is blamed, not the honest stage after it. Claimed experts are judged next,
stage by stage, then the last stage's tokens, each only when everything before passed; there
the column is the first failure of the replica whose own tokens fail most beyond the tolerated
share, not the group's first failing column (after a failover, that may be an honest replica's
rare miss). Tolerances are calibrated so that bf16 and fp32 replicas agree."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from decentrl.config import RunConfig, TrustConfig
from decentrl.model.moe import FREE_ROUTE
from decentrl.net.directory import Directory
from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import CLOSE_SESSION, VERIFY_STEP, CloseSession, VerifyStep
from decentrl.net.wire import WireError
from decentrl.rollout.generate import left_pad
from decentrl.rollout.routing import routing_tensor
from decentrl.rollout.sampling import sampling_config
from decentrl.rollout.types import Rollout, RolloutGroup
from decentrl.trust.commit import CommitTolerance, Sketches, check_sketches, earliest_failure
from decentrl.trust.provenance import Provenance, StageProvenance
from decentrl.trust.relay import BadReply, check_hidden_states
from decentrl.trust.reveal import RevealExpired, RevealFailed, RevealShape, revealed_sketches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """A group's generation session, teacher-forced: every column that was fed, and the token
    each column's output sampled (-1: none)."""

    ids: torch.Tensor  # [B, W] int64
    valid: torch.Tensor  # [B, W] bool
    positions: torch.Tensor  # [B, W] int64
    targets: torch.Tensor  # [B, W] int64
    claimed: torch.Tensor  # [B, W] float32 behaviour log-prob of each target (0: none)
    prompt_columns: int
    # A mixture of experts whose rollouts recorded their routing: the experts each fed column
    # went to, [B, W, every sparse layer, top_k] (FREE_ROUTE where nothing was recorded).
    experts: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def session_layout(group: RolloutGroup, pad_id: int, prompt_columns: int | None = None
                   ) -> Layout:
    """The group's rows in its session's columns: `prompt_columns`, the session's longest prompt
    (None: the group's own, the session of a group alone).

    Step 0 fed the left-padded prompts [B, P] and sampled completion token 0 from column P-1;
    step k >= 1 fed completion token k-1 at column P+k-1 (padding for rows already finished) and
    sampled token k there. The last token sampled is never fed.

    In a multi-turn episode some completion tokens were forced (an environment's reply, fed in
    place of the step's sample): they are fed like any other token, so the whole episode is
    teacher-forced and every stage's sketches are checked at their columns too, but they have
    no target (-1) and no claimed log-prob, since the model never sampled them.

    A rollout's routing record (a mixture of experts) names the experts of each completion
    token where it was fed: token k at column P + k."""
    rows = group.rollouts
    ids, prompt_valid = left_pad([r.prompt_tokens for r in rows], pad_id, torch.device("cpu"))
    batch, prompt = ids.shape
    if prompt_columns is not None:
        if prompt_columns < prompt:
            raise ValueError(f"the session's {prompt_columns} prompt columns cannot hold the "
                             f"group's prompt of {prompt} tokens")
        ids = torch.nn.functional.pad(ids, (prompt_columns - prompt, 0), value=pad_id)
        prompt_valid = torch.nn.functional.pad(prompt_valid, (prompt_columns - prompt, 0))
        prompt = prompt_columns
    steps = max(len(r.completion_tokens) for r in rows)
    width = prompt + steps - 1
    full = torch.full((batch, width), pad_id, dtype=torch.long)
    full[:, :prompt] = ids
    valid = torch.zeros((batch, width), dtype=torch.bool)
    valid[:, :prompt] = prompt_valid
    positions = torch.zeros((batch, width), dtype=torch.long)
    positions[:, :prompt] = (prompt_valid.long().cumsum(-1) - 1).clamp(min=0)
    targets = torch.full((batch, width), -1, dtype=torch.long)
    claimed = torch.zeros((batch, width))
    for row, rollout in enumerate(rows):
        tokens = rollout.completion_tokens
        fed = min(len(tokens), steps - 1)
        full[row, prompt:prompt + fed] = torch.tensor(tokens[:fed], dtype=torch.long)
        valid[row, prompt:prompt + fed] = True
        positions[row, prompt:] = torch.arange(len(rollout.prompt_tokens),
                                               len(rollout.prompt_tokens) + steps - 1)
        sampled = torch.tensor(rollout.generated_mask(), dtype=torch.bool)
        targets[row, prompt - 1:prompt - 1 + len(tokens)] = torch.tensor(
            tokens, dtype=torch.long).masked_fill(~sampled, -1)
        claimed[row, prompt - 1:prompt - 1 + len(tokens)] = torch.tensor(
            rollout.behaviour_logprobs, dtype=torch.float32).masked_fill(~sampled, 0.0)
    return Layout(full, valid, positions, targets, claimed, prompt,
                  layout_experts(rows, prompt, width))


def layout_experts(rows: Sequence[Rollout], prompt: int, width: int) -> torch.Tensor | None:
    """The rows' routing records in a session's columns (see `Layout.experts`), or None when no
    row carries one. ValueError if the records disagree on their layers or experts per token."""
    records = [(row, routing_tensor(r.routing)) for row, r in enumerate(rows)
               if r.routing is not None]
    if not records:
        return None
    shape = records[0][1].shape[1:]
    experts = torch.full((len(rows), width, *shape), FREE_ROUTE, dtype=records[0][1].dtype)
    for row, record in records:
        if record.shape[1:] != shape or record.dtype != experts.dtype:
            raise ValueError(f"row {row}'s routing record is {tuple(record.shape[1:])} "
                             f"{record.dtype}, row {records[0][0]}'s {tuple(shape)} "
                             f"{experts.dtype}")
        fed = min(record.shape[0], width - prompt)
        experts[row, prompt:prompt + fed] = record[:fed]
    return experts


def segments(group: RolloutGroup, layout: Layout, cuts: Iterable[int] = ()
             ) -> list[tuple[int, int, list[int]]]:
    """(first column, end column, versions per stage) of each span's decoding steps, each also
    cut at the columns of `cuts` (where a stage's cache was rebuilt, `StageProvenance.rebuilt`)."""
    steps = layout.width - layout.prompt_columns + 1
    spans = group.version_spans
    found = []
    for index, span in enumerate(spans):
        end_step = spans[index + 1].start if index + 1 < len(spans) else steps
        first = 0 if span.start == 0 else layout.prompt_columns + span.start - 1
        end = layout.prompt_columns + end_step - 1
        for cut in sorted({c for c in cuts if first < c < end}):
            found.append((first, cut, span.versions))
            first = cut
        found.append((first, end, span.versions))
    return found


@dataclass(frozen=True)
class Verdict:
    group_id: str
    outcome: Literal["passed", "failed", "skipped"]
    stage: int | None  # the stage blamed (failed)
    peer: str | None  # the replica blamed (failed)
    detail: str
    checked: tuple[int, ...]  # the stages whose work was judged (by another replica)
    seconds: float
    panel: tuple[str, ...]  # the peer that re-executed each stage
    # When the last stage was judged: every completion token's |claimed - re-executed|
    # behaviour log-prob and its seeded sampling margin (what the tolerances are set against).
    token_gaps: torch.Tensor | None = None
    token_margins: torch.Tensor | None = None
    # A mixture of experts' recorded routing, where it was judged: every claimed token's
    # routing gap (model/moe.py routing_gaps, the largest over a stage's sparse layers) at
    # each judged stage with sparse layers, in stage order.
    routing_gaps: torch.Tensor | None = None


class Verifier:
    def __init__(self, node: SwarmNode, directory: Directory, config: RunConfig,
                 hidden_size: int, pad_id: int, stage_routing: Sequence[slice] = ()) -> None:
        """`stage_routing`: each stage's part of a whole model's routing record
        (model/stages.py routing_layers); empty for a dense model."""
        self.node, self.directory, self.config = node, directory, config
        self.hidden_size, self.pad_id = hidden_size, pad_id
        self.stage_routing = tuple(stage_routing)
        self.tolerance = CommitTolerance.for_codec(config.swarm.activation_codec)
        # Who verifies must be unpredictable to peers: a liar that knew would pick its partner.
        self.random = secrets.SystemRandom()

    def panel(self, provenance: Provenance, avoid: frozenset[str] = frozenset(),
              contested: int | None = None, established_only: bool = False
              ) -> tuple[str, ...] | None:
        """One re-executing peer per stage, drawn at random (an unpredictable source, never by
        what peers announce) among the stage's eligible verifiers: never a peer that served the
        group, nor one of `avoid` (the verifiers of earlier opinions) where another exists, and
        not a peer on probation where an established one exists. A stage with no verifier but
        its own producers is re-executed by one of them: that feeds the later stages but judges
        nothing of its own (a consistent liar would agree with itself). None when some stage has
        nobody at all, or when the `contested` stage has no verifier outside `avoid`: a second
        opinion must come from someone else. With `established_only` (a panel whose opinion the
        tribunal may weigh, trust/tribunal.py) nobody on the panel is on probation, feeders
        included, or there is no panel."""
        producers = provenance.peers()
        on_probation = self.directory.on_probation

        def eligible(peers: list[str]) -> list[str]:
            established = [p for p in peers if not on_probation(p)]
            return established if established_only else established or peers

        chosen = []
        for stage in range(self.config.num_stages):
            fresh = eligible(self.directory.verifiers(stage, producers | avoid))
            if not fresh and stage == contested:
                return None
            pool = (fresh or eligible(self.directory.verifiers(stage, producers))
                    or eligible(self.directory.verifiers(stage, set())))
            if not pool:
                return None
            chosen.append(self.random.choice(pool))
        return tuple(chosen)

    def verify(self, group: RolloutGroup, provenance: Provenance,
               panel: tuple[str, ...]) -> Verdict:
        """Re-execute `group` on `panel` (one peer per stage, from `panel()`) and judge every
        stage whose re-executing peer did not serve the group."""
        started = time.monotonic()
        layout = session_layout(group, self.pad_id, provenance.prompt_columns)
        checked = tuple(s for s, peer in enumerate(panel)
                        if peer not in provenance.stage_peers(s))
        if not checked:
            return Verdict(group.group_id, "skipped", None, None, "no replica to re-execute on",
                           (), time.monotonic() - started, panel)
        stages = self.config.num_stages
        try:
            revealed = self._revealed(provenance, layout, [s for s in checked if s < stages - 1])
        except RevealExpired as expired:
            return Verdict(group.group_id, "skipped", None, None, str(expired), (),
                           time.monotonic() - started, panel)
        except RevealFailed as failed:
            return Verdict(group.group_id, "failed", failed.stage, failed.peer, str(failed),
                           tuple(s for s in checked if s <= failed.stage),
                           time.monotonic() - started, panel)
        session = secrets.token_hex(8)
        try:
            failure, scores = self._replay(group, layout, provenance, panel, session, checked,
                                           revealed)
        except (RemoteError, WireError, MessageLost, ValueError, TimeoutError) as error:
            return Verdict(group.group_id, "skipped", None, None, f"re-execution failed: {error}",
                           (), time.monotonic() - started, panel)
        finally:
            for peer in set(panel):
                try:
                    self.node.call_sync(peer, CLOSE_SESSION, CloseSession(session=session),
                                        timeout=5)
                except (RemoteError, WireError, MessageLost, TimeoutError):
                    pass  # the verifier drops idle sessions itself
        seconds = time.monotonic() - started
        if failure is None:
            return Verdict(group.group_id, "passed", None, None, "", checked, seconds, panel,
                           *scores)
        stage, column, detail = failure
        peer = provenance.stages[stage].peer_at(column)
        return Verdict(group.group_id, "failed", stage, peer, detail,
                       tuple(s for s in checked if s <= stage), seconds, panel, *scores)

    def _revealed(self, provenance: Provenance, layout: Layout, stages: list[int]
                  ) -> dict[int, Sketches]:
        """A peer-to-peer session's delivered activations of `stages`, from its replicas'
        reveals (trust/reveal.py); nothing for a relayed session (its sketches are kept)."""
        if not provenance.session or not stages:
            return {}
        return revealed_sketches(
            self.node, provenance, stages,
            RevealShape(layout.positions, layout.valid, self.hidden_size),
            self.config.trust.sketch_dims, self.config.trust.reveal_window_s,
            self.config.swarm.request_timeout_s, self._announced)

    def _announced(self, peer: str) -> bool:
        """Whether `peer` is still here: it announces itself (looked up again) and answers (a
        close of a session nobody opened: every inference peer serves it)."""
        self.directory.refresh()
        if peer not in self.directory.records():
            return False
        try:
            self.node.call_sync(peer, CLOSE_SESSION, CloseSession(session=secrets.token_hex(8)),
                                timeout=5)
        except (RemoteError, WireError, MessageLost, TimeoutError):
            return False
        return True

    def _replay(self, group: RolloutGroup, layout: Layout, provenance: Provenance,
                verifiers: tuple[str, ...], session: str, checked: tuple[int, ...],
                revealed: dict[int, Sketches]
                ) -> tuple[tuple[int, int, str] | None, tuple[torch.Tensor | None, ...]]:
        """Re-execute every segment on the verifiers: (stage, column, why) of the first lie
        among the `checked` stages, or None; and the token gaps and margins and the routing
        gaps where judged. The delivered activations are the kept sketches, or `revealed`."""
        rollout, trust = self.config.rollout, self.config.trust
        stages = self.config.num_stages
        batch = layout.ids.shape[0]
        # Every stage's re-executed hidden states, checked once at the end: the mean-error test
        # of a sketch check needs many positions, more than one segment may have.
        hidden_states = torch.zeros((stages - 1, batch, layout.width, self.hidden_size))
        scores = torch.zeros((2, batch, layout.width))
        routing = torch.zeros((stages, batch, layout.width))  # each stage's routing gaps
        rebuilt = [set(provenance.stages[stage].rebuilt) for stage in range(stages)]
        sampling = (sampling_config(rollout) if provenance.sampling is None
                    else provenance.sampling)
        for first, end, versions in segments(group, layout, set().union(*rebuilt)):
            x: torch.Tensor = layout.ids[:, first:end]
            for stage, peer in enumerate(verifiers):
                last = stage == stages - 1
                # Where the session replayed this stage from position 0, so does the check: the
                # earlier columns again, at this segment's version, as the replica recomputed
                # them; only the new columns' outputs go on and are judged.
                start = 0 if first in rebuilt[stage] else first
                if start < first:
                    earlier = layout.ids if stage == 0 else hidden_states[stage - 1]
                    x = torch.cat([earlier[:, :first], x], 1)
                body = VerifyStep(
                    session=session, start=start, batch=batch, max_length=layout.width,
                    version=versions[stage], prompt_columns=layout.prompt_columns,
                    sampling=sampling if last else None,
                    sampling_seed=group.sampling_seed if last else None,
                    first_row=provenance.first_row if last else 0)
                tensors = {"inputs": x, "positions": layout.positions[:, start:end],
                           "key_valid": layout.valid[:, :end]}
                if last:
                    targets = layout.targets[:, start:end].clone()
                    targets[:, :first - start] = -1  # sampled (and scored) before the replay
                    tensors["targets"] = targets
                claims = self._claims(stage, layout)
                if claims is not None:
                    tensors["experts"] = claims = claims[:, start:end].clone()
                    claims[:, :first - start] = FREE_ROUTE  # judged before the replay
                _, out = self.node.call_sync(peer, VERIFY_STEP, body, tensors,
                                             self.config.swarm.activation_codec,
                                             self.config.swarm.request_timeout_s)
                if claims is not None:
                    gaps = out.get("routing_gaps")
                    if gaps is None or not gaps.is_floating_point() \
                            or gaps.shape != (batch, end - start) \
                            or not bool(torch.isfinite(gaps).all()) or bool((gaps < 0).any()):
                        raise WireError(f"verifier {peer[-8:]} replied no routing gaps "
                                        f"[{batch}, {end - start}] (finite, >= 0)")
                    routing[stage, :, first:end] = gaps[:, first - start:].float()
                if last:
                    for index, name in enumerate(("logprobs", "margins")):
                        value = out.get(name)
                        if value is None or value.shape != (batch, end - start):
                            raise WireError(f"verifier {peer[-8:]} replied no {name} "
                                            f"[{batch}, {end - start}]")
                        scores[index, :, first:end] = value[:, first - start:].float()
                    continue
                # Checked whole before the next stage's verifier gets it (trust/relay.py).
                try:
                    x = check_hidden_states(out.get("hidden"), batch, end - start,
                                            self.hidden_size)[:, first - start:].float()
                except BadReply as bad:
                    raise BadReply(f"verifier {peer[-8:]}: {bad}") from None
                hidden_states[stage, :, first:end] = x
        checks = []
        for stage in (s for s in checked if s < stages - 1):
            record = provenance.stages[stage]
            matrix = record.matrix(trust.sketch_dims, self.hidden_size)
            delivered = revealed[stage] if stage in revealed \
                else Sketches.concat(record.sketches, trust.sketch_dims)
            checks.append((stage, check_sketches(
                delivered, matrix,
                hidden_states[stage], layout.positions, layout.valid, self.tolerance)))
        blamed = earliest_failure(checks)
        if blamed is not None:
            stage, row, position = blamed
            check = dict(checks)[stage]
            column = layout.prompt_columns - len(group.rollouts[row].prompt_tokens) + position
            detail = (f"stage {stage}: {check.failed} of {check.checked} positions differ from "
                      f"the re-execution (worst relative error {check.worst:.3f}, mean "
                      f"{check.mean:.3f})")
            return (stage, column, detail), (None, None, None)
        routed = [(stage, claims) for stage in checked
                  if (claims := self._claims(stage, layout)) is not None]
        routing_gaps = (torch.cat([routing[stage][claimed_tokens(claims)]
                                   for stage, claims in routed]) if routed else None)
        for stage, claims in routed:
            found = judge_routing(stage, claimed_tokens(claims), routing[stage],
                                  provenance.stages[stage], trust)
            if found is not None:
                return (stage, *found), (None, None, routing_gaps)
        if stages - 1 not in checked:
            return None, (None, None, routing_gaps)
        scored = layout.targets >= 0
        gaps = (layout.claimed - scores[0]).abs()[scored]
        margins = scores[1][scored]
        found = judge_tokens(layout, gaps, margins, provenance.stages[stages - 1], trust)
        if found is None:
            return None, (gaps, margins, routing_gaps)
        column, detail = found
        return (stages - 1, column, detail), (gaps, margins, routing_gaps)

    def _claims(self, stage: int, layout: Layout) -> torch.Tensor | None:
        """The experts the rollouts claim for `stage`'s sparse layers, [B, W, its layers,
        top_k]; None where the stage has none or the rollouts recorded no routing."""
        if layout.experts is None or stage >= len(self.stage_routing):
            return None
        part = self.stage_routing[stage]
        return layout.experts[:, :, part] if part.stop > part.start else None


def claimed_tokens(claims: torch.Tensor) -> torch.Tensor:
    """[B, W] bool: the positions `claims` [B, W, layers, top_k] name experts for."""
    return (claims != FREE_ROUTE).flatten(2).any(-1)


def too_many_mismatches(failed: int, total: int, allowed: float, allowed_items: int) -> bool:
    """Whether `failed` of `total` judged items fail a check: more than the `allowed` share of
    them and more than `allowed_items`."""
    return failed > max(allowed * total, allowed_items)


def blame_excess(bad: torch.Tensor, columns: torch.Tensor, served: StageProvenance,
                 allowed: float, allowed_items: int = 0) -> tuple[str, int, int, int] | None:
    """Among the replicas that served `columns` (of the judged items, `bad` marking those that
    failed), the one with the most failures beyond the `allowed` share of its own items: (the
    replica, its first failing column, its failures, its items). None when the failures are
    within the `allowed` share of all items, or no more than `allowed_items` (a small group
    does not fail on one rare numeric miss). After a failover, the replica that did the bad
    work is blamed, not the first column to fail, which may be an honest replica's rare
    numeric miss."""
    if not too_many_mismatches(int(bad.sum()), bad.numel(), allowed, allowed_items):
        return None
    replica_of_column = {c: served.peer_at(c) for c in sorted(set(columns.tolist()))}
    served_by = [replica_of_column[int(column)] for column in columns]
    replicas = list(dict.fromkeys(replica_of_column.values()))  # in column order

    def share(peer: str) -> torch.Tensor:
        return torch.tensor([p == peer for p in served_by], dtype=torch.bool)

    def excess(peer: str) -> float:
        theirs = share(peer)
        return int((bad & theirs).sum()) - allowed * int(theirs.sum())
    blamed = max(replicas, key=excess)  # the first of equals
    theirs = share(blamed)
    return (blamed, int(columns[bad & theirs].min()), int((bad & theirs).sum()),
            int(theirs.sum()))


def judge_routing(stage: int, claimed: torch.Tensor, gaps: torch.Tensor,
                  served: StageProvenance, trust: TrustConfig) -> tuple[int, str] | None:
    """A sparse stage's verdict on the experts its replicas claimed at the `claimed` [B, W]
    positions, from the re-execution's routing `gaps` [B, W]: None when the share of claims
    beyond `trust.routing_tolerance` is within `trust.max_mismatch_fraction`, else (a failing
    column, why)."""
    scored = gaps[claimed]
    bad = scored > trust.routing_tolerance
    found = blame_excess(bad, claimed.nonzero()[:, 1], served, trust.max_mismatch_fraction,
                         trust.mismatched_tokens_allowed)
    if found is None:
        return None
    blamed, column, failed, total = found
    return column, (f"stage {stage}: {int(bad.sum())} of {bad.numel()} tokens' claimed experts "
                    f"are not the router's choice in the re-execution, {failed} of the {total} "
                    f"its replica {blamed[-8:]} served (worst routing gap "
                    f"{float(scored.max()):.2f} nats)")


def judge_tokens(layout: Layout, gaps: torch.Tensor, margins: torch.Tensor,
                 served: StageProvenance, trust: TrustConfig) -> tuple[int, str] | None:
    """The last stage's verdict from every scored token's log-prob gap and sampling margin (in
    the row-major order of `layout.targets >= 0`): None when the group's share of tokens that do
    not re-execute is within `trust.max_mismatch_fraction` (or their number within
    `trust.mismatched_tokens_allowed`), else (a failing column, why): the
    first failing column of the replica `blame_excess` names."""
    bad = (gaps > trust.logprob_tolerance) | (margins > trust.sampling_tolerance)
    found = blame_excess(bad, (layout.targets >= 0).nonzero()[:, 1], served,
                         trust.max_mismatch_fraction, trust.mismatched_tokens_allowed)
    if found is None:
        return None
    blamed, column, failed, total = found
    detail = (f"last stage: {int(bad.sum())} of {bad.numel()} tokens do not re-execute, "
              f"{failed} of the {total} tokens its replica {blamed[-8:]} sampled (worst "
              f"log-prob gap {float(gaps.max()):.2f}, worst sampling margin "
              f"{float(margins.max()):.2f})")
    return column, detail
