"""Reveals: what a spot-check takes of a peer-to-peer session's activations (`swarm.data_plane =
"peer_to_peer"`), in place of the sketches a relaying coordinator keeps.

The coordinator never saw the hidden states: it holds each stage's signed commitment, a digest
per row of every step's output (trust/provenance.py `Commitment`). A check asks each replica that
served a checked stage to reveal the group's rows of everything it sent on in the session
(stage/push.py keeps them for `trust.reveal_window_s` after the session ends), hashes every
revealed row against the digest its sender signed, and sketches the rows with the session's
secret matrix, drawn by the coordinator: from there the check is the relayed one (trust/commit.py,
trust/verify.py). A replica that does not reveal what it signed (it answers nothing, refuses, or
reveals rows that do not hash to its digests) is blamed: an honest replica keeps what it sent for
the whole window (it refuses new sessions rather than forget), so only a liar cannot reveal. What
changed against relaying: the hidden states reach the coordinator only for the groups it checks,
after the fact, and a stage whose replica is gone past the window cannot be checked.

Each column is checked where it was first delivered: a failover's replay resends kept columns
(checked against their digests like the rest, not sketched twice)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decentrl.net.link import MessageLost
from decentrl.net.node import RemoteError, SwarmNode
from decentrl.net.protocol import REVEAL
from decentrl.net.push_messages import RevealRequest, row_digests
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
                      shape: RevealShape, dims: int, window_s: float, timeout_s: float
                      ) -> dict[int, Sketches]:
    """The sketches of what each of `stages` delivered to the next stage at the group's rows,
    from its replicas' reveals checked against their commitments. RevealFailed names a replica
    that did not reveal; RevealExpired: the session is past the window."""
    if time.monotonic() - provenance.finished > window_s:
        raise RevealExpired(f"the session ended {time.monotonic() - provenance.finished:.0f}s "
                            f"ago, past trust.reveal_window_s ({window_s:.0f}s)")
    found = {}
    for stage in stages:
        record = provenance.stages[stage]
        matrix = record.matrix(dims, shape.hidden_size)
        parts, covered = [], torch.zeros_like(shape.valid)
        for peer, commitments in _by_peer(record.commitments).items():
            for commitment, rows in _reveal(node, provenance, stage, peer, commitments,
                                            shape, timeout_s):
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


def _by_peer(commitments: list[Commitment]) -> dict[str, list[Commitment]]:
    grouped: dict[str, list[Commitment]] = {}
    for commitment in commitments:
        grouped.setdefault(commitment.peer, []).append(commitment)
    return grouped


def _reveal(node: SwarmNode, provenance: Provenance, stage: int, peer: str,
            commitments: list[Commitment], shape: RevealShape, timeout_s: float
            ) -> list[tuple[Commitment, torch.Tensor]]:
    """Each of `peer`'s commitments with its revealed rows [B, new, hidden], checked."""
    first = commitments[0].start
    rows = shape.valid.shape[0]
    try:
        body, out = node.call_sync(peer, REVEAL, RevealRequest(
            provenance.session, provenance.first_row, rows), timeout=timeout_s)
    except (RemoteError, WireError, MessageLost, TimeoutError) as error:
        raise RevealFailed(stage, peer, first, f"revealed nothing: {error}") from None
    outputs = out.get("outputs")
    total = sum(new for _, _, new in body.steps)
    if outputs is None or not outputs.is_floating_point() \
            or tuple(outputs.shape) != (rows, total, shape.hidden_size):
        raise RevealFailed(stage, peer, first, f"revealed outputs "
                           f"{None if outputs is None else tuple(outputs.shape)}, not "
                           f"[{rows}, {total}, {shape.hidden_size}]")
    offsets, offset = {}, 0
    for epoch, start, new in body.steps:
        offsets.setdefault((epoch, start, new), offset)
        offset += new
    checked = []
    for commitment in commitments:
        at = offsets.get((commitment.epoch, commitment.start, commitment.new))
        span = f"columns [{commitment.start}, {commitment.start + commitment.new})"
        if at is None:
            raise RevealFailed(stage, peer, commitment.start, f"did not reveal the {span} it "
                               f"signed for (epoch {commitment.epoch})")
        revealed = outputs[:, at:at + commitment.new]
        if tuple(row_digests(revealed)) != commitment.rows:
            raise RevealFailed(stage, peer, commitment.start, f"revealed {span} that do not "
                               "hash to what it signed")
        checked.append((commitment, revealed))
    return checked
