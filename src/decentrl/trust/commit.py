"""Activation commitments (after TOPLOC): an inference stage attaches to each reply, at every
`interval`-th token position, the top-k hidden dims of its output by magnitude and their values.
A verifier later recomputes the hidden states (teacher-forced, maybe on other hardware, in
another dtype, with the batch left-padded differently) and checks the claim against them.

Points are named by (row, position id), not by column: position ids count a row's real tokens,
so they do not move with left padding. Values are rounded through bfloat16, so a claim is the
same whatever noise the compute dtype adds below that precision; the tolerance covers the rest.
On the wire the values are their bf16 bits as int16: integer tensors travel raw, so a lossy
activation codec (int8) never touches a claim that a mismatch would turn into proof of a lie.

What this tells apart (calibration in `CommitTolerance`): other inputs, weights or layers, dims
that are not the top-k, and an output scaled by 1.1 fail. Gaussian noise of 0.1x a row's std
fails on the tiny test model. SmolLM2's honest bf16-vs-fp32 differences are as large as noise of
~0.05x: there 0.1x passes, and 0.2x fails a 448-point check and 57-74 % of 16-point ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

WIRE_NAMES = ("commit_rows", "commit_positions", "commit_indices", "commit_values")
# Position ids are packed with their row into one int64 key (row * 2^32 + position).
MAX_POSITION = 2**32


@dataclass(frozen=True)
class CommitTolerance:
    """How far a recomputation may differ from a claim. An entry's error is
    |recomputed - claimed| / (|claimed| + atol * rms), rms being the recomputed row's root mean
    square (scale-free: hidden scales differ between models and layers). A point fails when more
    than `max_bad_fraction` of its entries exceed `rel_tol` (values that are not the recomputed
    ones), or when a claimed magnitude is below `min_topk_ratio` x the recomputed k-th largest
    (dims that are not the top-k). Subtler changes only show in the mean: over at least
    `mean_min_points` points, a mean entry error above `max_mean_error` fails every point whose
    own mean is above it.

    Calibrated on honest computation: KV-cache decoding of a left-padded batch of 8 rows against
    teacher-forced recomputation of the batch with 3 more padding columns, bf16 vs fp32 both
    ways, top-8 at every position (tests/test_commit.py repeats it in small). Measured:
    - honest recomputation, worst entry error / worst 5th-largest of a point's 8 / worst mean
      over 16 points: tiny test models (hidden 32, 465 points each) 0.060 / 0.021 / 0.010;
      SmolLM2-135M stage 0 (15 layers, hidden 576, 448 points) 0.483 / 0.032 / 0.0155.
    - hidden states that crossed the int8 activation codec (the client's self-check, or a
      verifier's reply): SmolLM2 0.492 / 0.071 / 0.025 (massive activations set the int8 step
      of their rows); tiny models 0.060 / 0.024 / 0.011.
    - corrupted claims (a bf16 output with Gaussian noise of s x its row's std, or x 1.1),
      mean error over 16 points: x 1.1 >= 0.083 on every model; noise 0.1: 0.038-0.059 tiny,
      0.017-0.039 SmolLM2; noise 0.2: >= 0.075 tiny, 0.033-0.096 SmolLM2; noise 0.05:
      0.019-0.032 tiny, 0.009-0.021 SmolLM2 (overlaps honest SmolLM2: undetectable).
    So: per point, 4.7x the honest worst (2.1x through int8); the mean, 2.6x the honest worst
    (1.6x through int8) and 2.1x under a 10 % scaling.
    """

    rel_tol: float = 0.15
    atol: float = 0.1
    max_bad_fraction: float = 0.5
    min_topk_ratio: float = 0.5  # honest claims are >= 0.94x the recomputed k-th magnitude
    max_mean_error: float = 0.04
    mean_min_points: int = 16


@dataclass(frozen=True)
class Commitment:
    """Claimed points: rows [N], position ids [N], hidden dims [N, k], values [N, k] (float32)."""

    rows: torch.Tensor
    positions: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.rows.numel()

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]

    def select(self, keep: torch.Tensor) -> Commitment:
        """The points where `keep` [N] (bool) is True."""
        return Commitment(self.rows[keep], self.positions[keep], self.indices[keep],
                          self.values[keep])

    def within(self, positions: torch.Tensor, valid: torch.Tensor) -> Commitment:
        """The points at valid entries of `positions` [B, T] (one reply's new positions, say)."""
        return self.select(_locate(self.rows, self.positions, positions, valid)[0])

    @staticmethod
    def concat(parts: Sequence[Commitment], top_k: int) -> Commitment:
        """The points of many replies (of one session) as one commitment."""
        if any(part.top_k != top_k for part in parts):
            raise ValueError(f"cannot concatenate commitments of other top-k than {top_k}")
        if not parts:
            empty = torch.zeros(0, dtype=torch.long)
            return Commitment(empty, empty, torch.zeros(0, top_k, dtype=torch.long),
                              torch.zeros(0, top_k))
        return Commitment(*(torch.cat([getattr(part, name) for part in parts])
                            for name in ("rows", "positions", "indices", "values")))


@dataclass(frozen=True)
class CommitCheck:
    checked: int  # claimed points found among the recomputed hidden states
    failed: int
    worst: float  # the largest entry error (see CommitTolerance) over the checked points
    mean: float  # the mean entry error over the checked points
    first_failure: tuple[int, int] | None  # (row, position) of the earliest failing point


def commit_points(positions: torch.Tensor, valid: torch.Tensor, interval: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N], columns [N]) of the valid entries of `positions` [B, T] whose position id is a
    multiple of `interval`, in row-major order."""
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    rows, cols = (valid & (positions % interval == 0)).nonzero(as_tuple=True)
    return rows, cols


def make_commitment(hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                    interval: int, top_k: int) -> Commitment:
    """The commitment of a stage's output `hidden` [B, T, H] at the new positions `positions`
    [B, T] (`valid` marks real tokens), on the CPU."""
    positions, valid = positions.to(hidden.device), valid.to(hidden.device)
    rows, cols = commit_points(positions, valid, interval)
    points = hidden[rows, cols].float()
    indices = points.abs().topk(top_k, dim=-1).indices
    values = points.gather(-1, indices).to(torch.bfloat16).float()
    return Commitment(rows.cpu(), positions[rows, cols].cpu(), indices.cpu(), values.cpu())


def commitment_to_wire(commitment: Commitment) -> dict[str, torch.Tensor]:
    bits = commitment.values.to(torch.bfloat16).view(torch.int16)
    return dict(zip(WIRE_NAMES, (commitment.rows, commitment.positions, commitment.indices,
                                 bits)))


def parse_commitment(tensors: Mapping[str, torch.Tensor], batch: int, hidden_size: int,
                     top_k: int) -> Commitment:
    """A commitment from a peer's reply tensors (other tensors of the reply are ignored), checked
    for everything a forged one could break; ValueError says what is wrong."""
    missing = [name for name in WIRE_NAMES if name not in tensors]
    if missing:
        raise ValueError(f"the reply has no commitment tensors {missing}")
    rows, positions, indices, values = (tensors[name] for name in WIRE_NAMES)
    for name, tensor in zip(WIRE_NAMES[:3], (rows, positions, indices)):
        if tensor.dtype != torch.long:
            raise ValueError(f"{name} must be int64, got {tensor.dtype}")
    if values.dtype != torch.int16:
        raise ValueError(f"commit_values must be bf16 bits as int16, got {values.dtype}")
    count = rows.shape[0] if rows.dim() == 1 else -1
    if count < 0 or positions.shape != (count,) or indices.shape != (count, top_k) \
            or values.shape != (count, top_k):
        raise ValueError(f"commitment shapes must be [N], [N], [N, {top_k}], [N, {top_k}]; got "
                         f"{[tuple(t.shape) for t in (rows, positions, indices, values)]}")
    commitment = Commitment(rows, positions, indices, values.view(torch.bfloat16).float())
    if count == 0:
        return commitment
    if int(rows.min()) < 0 or int(rows.max()) >= batch:
        raise ValueError(f"commit_rows must be in [0, {batch})")
    if int(positions.min()) < 0 or int(positions.max()) >= MAX_POSITION:
        raise ValueError(f"commit_positions must be in [0, {MAX_POSITION})")
    if int(indices.min()) < 0 or int(indices.max()) >= hidden_size:
        raise ValueError(f"commit_indices must be in [0, {hidden_size})")
    if top_k > 1 and bool((indices.sort(-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("commit_indices repeat a hidden dim within a point")
    if not bool(torch.isfinite(commitment.values).all()):
        raise ValueError("commit_values must be finite")
    if _keys(rows, positions).unique().numel() != count:
        raise ValueError("the commitment names a (row, position) point twice")
    return commitment


def check_commitment(claimed: Commitment, hidden: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor, tolerance: CommitTolerance) -> CommitCheck:
    """Compare `claimed` with recomputed hidden states [B, T, H] at the same (row, position)
    points; claimed points that are not valid entries of `positions` [B, T] are not checked."""
    found, cols = _locate(claimed.rows, claimed.positions, positions, valid)
    claim = claimed.select(found)
    if len(claim) == 0:
        return CommitCheck(0, 0, 0.0, 0.0, None)
    device = hidden.device
    points = hidden[claim.rows.to(device), cols[found].to(device)].float()
    values = claim.values.to(device)
    recomputed = points.gather(-1, claim.indices.to(device))
    rms = points.pow(2).mean(-1, keepdim=True).sqrt()
    error = (recomputed - values).abs() / (values.abs() + tolerance.atol * rms)
    bad = (error > tolerance.rel_tol).float().mean(-1) > tolerance.max_bad_fraction
    kth = points.abs().topk(claim.top_k, dim=-1).values[:, -1:]
    not_top = (values.abs() < tolerance.min_topk_ratio * kth).any(-1)
    point_mean = error.mean(-1)
    mean = float(point_mean.mean())
    failed = bad | not_top
    if len(claim) >= tolerance.mean_min_points and mean > tolerance.max_mean_error:
        # The mean of the points' means is over the bound only if some are: those points fail.
        failed |= point_mean > tolerance.max_mean_error
    failed = failed.cpu()
    first = None
    if bool(failed.any()):
        # The earliest position: where the claim and the recomputation start to disagree.
        position, row = min(zip(claim.positions[failed].tolist(), claim.rows[failed].tolist()))
        first = (row, position)
    return CommitCheck(len(claim), int(failed.sum()), float(error.max()), mean, first)


def _keys(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rows.long() * MAX_POSITION + positions.long()


def _locate(rows: torch.Tensor, claimed: torch.Tensor, positions: torch.Tensor,
            valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For points (rows [N], position ids `claimed` [N]): whether each is a valid entry of
    `positions` [B, T] and, where it is, its column (on the CPU)."""
    positions, valid = positions.cpu(), valid.cpu()
    at_rows, at_cols = valid.nonzero(as_tuple=True)
    keys, order = _keys(at_rows, positions[at_rows, at_cols]).sort()
    wanted = _keys(rows.cpu(), claimed.cpu())
    if len(keys) == 0:
        return torch.zeros(len(wanted), dtype=torch.bool), torch.zeros_like(wanted)
    slot = torch.searchsorted(keys, wanted).clamp(max=len(keys) - 1)
    found = keys[slot] == wanted
    return found, torch.where(found, at_cols[order[slot]], 0)
