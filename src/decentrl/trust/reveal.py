"""Reveals: what a spot-check takes of a peer-to-peer session's activations (`swarm.data_plane =
"peer_to_peer"`), in place of the sketches a relaying coordinator keeps.

The coordinator never saw the hidden states: it holds each stage's signed commitment, a digest
per row of every step's output (trust/provenance.py `Commitment`). A check asks each replica that
served a checked stage to reveal the group's rows of everything it sent on in the session
(stage/push.py keeps them for `trust.reveal_window_s` after the session ends), hashes every
revealed row against the digest its sender signed, and sketches the rows with the session's
secret matrix, drawn by the coordinator: from there the check is the relayed one (trust/commit.py,
trust/verify.py). What a stage sent is kept twice: by its sender and by the replica of the next
stage it was pushed to (which checked it against the sender's digests when it came), so a
replica that left or restarted is revealed for by its receiver. A revealed row that does not
hash to its sender's digest is proof against whoever revealed it; a sender that is still
announced and for which nobody reveals is blamed (an honest replica keeps what it sent for the
whole window, refusing new sessions rather than forgetting); where the sender left and its
receivers reveal nothing, the check is skipped. What changed against relaying: the hidden
states reach the coordinator only for the groups it checks, after the fact.

Each column is checked where it was first delivered: a failover's replay resends kept columns
(checked against their digests like the rest, not sketched twice)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import REVEAL
from decentrl.net.push_messages import (
    MAX_REVEALED_STEPS,
    RevealRequest,
    chain_digest,
    row_digests,
)
from decentrl.net.wire import WireError
from decentrl.trust.commit import Sketches, take_sketches
from decentrl.trust.provenance import Commitment, Provenance


class RevealFailed(Exception):
    """`peer`, which served `stage` from `column` on, did not reveal what it signed."""

    def __init__(self, stage: int, peer: str, column: int, detail: str) -> None:
        super().__init__(f"stage {stage}: replica {peer[-8:]} {detail}")
        self.stage, self.peer, self.column = stage, peer, column


class RevealExpired(Exception):
    """The session ended longer than the reveal window ago: its stages need not reveal it."""


@dataclass(frozen=True)
class RevealShape:
    """Where a group's rows sit: `positions` and `valid` [B, W] of its layout (session columns),
    and the model's hidden width."""

    positions: torch.Tensor
    valid: torch.Tensor
    hidden_size: int


def revealed_sketches(node: SwarmNode, provenance: Provenance, stages: Sequence[int],
                      shape: RevealShape, dims: int, window_s: float, timeout_s: float,
                      alive: Callable[[str], bool]) -> dict[int, Sketches]:
    """The sketches of what each of `stages` delivered to the next stage at the group's rows,
    from reveals checked against the senders' commitments: each sender's own, or where it
    reveals nothing (it left, or lost what it kept in a restart), the next stage's replicas',
    which kept what they were pushed. RevealFailed names a replica that revealed something its
    sender never signed, or a sender still `alive` (announced) whom nobody could reveal for;
    RevealExpired: the session is past the window, or nobody is left to reveal it."""
    if time.monotonic() - provenance.finished > window_s:
        raise RevealExpired(f"the session ended {time.monotonic() - provenance.finished:.0f}s "
                            f"ago, past trust.reveal_window_s ({window_s:.0f}s)")
    found = {}
    for stage in stages:
        record = provenance.stages[stage]
        matrix = record.matrix(dims, shape.hidden_size)
        parts, covered = [], torch.zeros_like(shape.valid)
        for sender, commitments in _grouped(record.commitments, "peer").items():
            for commitment, rows in _revealed(node, provenance, stage, sender, commitments,
                                              shape, timeout_s, alive):
                end = min(commitment.start + commitment.new, shape.valid.shape[1])
                if end <= commitment.start:
                    continue
                columns = slice(commitment.start, end)
                fresh = shape.valid[:, columns] & ~covered[:, columns]
                covered[:, columns] |= fresh
                parts.append(take_sketches(rows[:, :end - commitment.start].float(),
                                           shape.positions[:, columns], fresh, matrix))
        found[stage] = Sketches.concat(parts, dims)
    return found


class _Unrevealed(Exception):
    """A peer revealed nothing (unreachable, or it keeps nothing): no proof of anything."""


def _grouped(commitments: list[Commitment], by: str) -> dict[str, list[Commitment]]:
    grouped: dict[str, list[Commitment]] = {}
    for commitment in commitments:
        grouped.setdefault(getattr(commitment, by), []).append(commitment)
    return grouped


def _revealed(node: SwarmNode, provenance: Provenance, stage: int, sender: str,
              commitments: list[Commitment], shape: RevealShape, timeout_s: float,
              alive: Callable[[str], bool]) -> list[tuple[Commitment, torch.Tensor]]:
    """Each of `sender`'s commitments with its revealed rows [B, new, hidden], checked: from the
    sender, else from the replicas it pushed them to."""
    try:
        return _ask(node, provenance, stage, sender, commitments, shape, timeout_s, False)
    except _Unrevealed as silence:
        from_sender = silence
    found = []
    for receiver, theirs in _grouped(commitments, "receiver").items():
        try:
            found += _ask(node, provenance, stage + 1, receiver, theirs, shape, timeout_s, True)
        except _Unrevealed as silence:
            why = (f"revealed nothing ({from_sender}), nor did replica {receiver[-8:]} it pushed "
                   f"them to ({silence})")
            if not alive(sender):
                raise RevealExpired(f"stage {stage}: replica {sender[-8:]} left and {why}")\
                    from None
            raise RevealFailed(stage, sender, theirs[0].start, why) from None
    return found


def _ask(node: SwarmNode, provenance: Provenance, stage: int, peer: str,
         commitments: list[Commitment], shape: RevealShape, timeout_s: float, received: bool
         ) -> list[tuple[Commitment, torch.Tensor]]:
    """`peer`'s reveal of `commitments` (what it sent, or with `received` what it was pushed),
    each checked against its digest; RevealFailed (proof) where one does not match. Asked in
    parts of at most a session's positions (a failover's replays resend a session whole)."""
    checked = []
    for part in _parts(commitments, shape.valid.shape[1]):
        checked += _ask_part(node, provenance, stage, peer, part, shape, timeout_s, received)
    return checked


def _parts(commitments: list[Commitment], columns: int) -> list[list[Commitment]]:
    """`commitments` in runs of at most `columns` columns (one alone may be longer: a session's
    whole is at most the session) and MAX_REVEALED_STEPS steps."""
    parts: list[list[Commitment]] = [[]]
    for commitment in commitments:
        run = parts[-1]
        if run and (sum(c.new for c in run) + commitment.new > columns
                    or len(run) == MAX_REVEALED_STEPS):
            parts.append(run := [])
        run.append(commitment)
    return [run for run in parts if run]


def _ask_part(node: SwarmNode, provenance: Provenance, stage: int, peer: str,
              commitments: list[Commitment], shape: RevealShape, timeout_s: float,
              received: bool) -> list[tuple[Commitment, torch.Tensor]]:
    rows = shape.valid.shape[0]
    first = commitments[0].start
    steps = [(c.epoch, c.start, c.new) for c in commitments]
    try:
        body, out = node.call_sync(peer, REVEAL, RevealRequest(
            provenance.session, provenance.first_row, rows, steps, received), timeout=timeout_s)
    except (RemoteError, WireError, MessageLost, TimeoutError) as error:
        raise _Unrevealed(str(error)) from None
    outputs = out.get("outputs")
    total = sum(c.new for c in commitments)
    if outputs is None or not outputs.is_floating_point() \
            or tuple(outputs.shape) != (rows, total, shape.hidden_size) \
            or len(body.digests) != len(commitments):
        raise RevealFailed(stage, peer, first, f"revealed outputs "
                           f"{None if outputs is None else tuple(outputs.shape)} and "
                           f"{len(body.digests)} steps' digests, not [{rows}, {total}, "
                           f"{shape.hidden_size}] and {len(commitments)}")
    checked, at = [], 0
    for commitment, digests in zip(commitments, body.digests, strict=True):
        span = f"columns [{commitment.start}, {commitment.start + commitment.new})"
        revealed = outputs[:, at:at + commitment.new]
        at += commitment.new
        own = digests[provenance.first_row:provenance.first_row + rows]
        if chain_digest(digests) != commitment.digest or row_digests(revealed) != own:
            raise RevealFailed(stage, peer, commitment.start, f"revealed {span} that do not "
                               "hash to what their sender signed")
        checked.append((commitment, revealed))
    return checked
