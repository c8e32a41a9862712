"""Activation sketches: what the coordinator keeps of every hidden state an inference stage
delivered, so that a spot-check can later tell whether the stage computed it.

The reply itself is the stage's commitment (its sender signed the envelope). The coordinator,
which relays every reply, keeps a secret random sketch of it at every valid new position:
R @ h, with R a Gaussian [dims, hidden] matrix drawn per session and stage from a seed only the
coordinator knows (provenance.py). A verifier's re-executed hidden states are sketched with the
same R and compared position by position. A stage cannot predict which positions or directions
are checked: every position is, and a change in any direction of the hidden state moves the
sketch by about as much as it moves the state (Johnson-Lindenstrauss), whatever R is.

Points are named by (row, position id), not by column: position ids count a row's real tokens,
so they do not move with left padding. The sketch is of the raw hidden state. An elementwise
squash first, h / (|h| + a * scale(h)), meant to keep SmolLM2's massive activations (~25,000)
from hiding the ordinary dims, did worse when measured on SmolLM2 stage 0 (a = 0.1-10, scale =
rms or median |h|): it doubled the honest error (worst 0.087-0.12 against 0.042 raw), caught
noise of 0.1x std at 51-78 % of positions against 91 % raw, and no output scaled by 1.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decentrl.net.wire import ActivationCodec

# Kept sketches are rounded to bf16 (an error of ~0.001 of a position's sketch, 10x under the
# honest one): the range of fp32, half the memory.
SKETCH_DTYPE = torch.bfloat16
# Position ids are packed with their row into one int64 key (row * 2^32 + position).
MAX_POSITION = 2**32


@dataclass(frozen=True)
class CommitTolerance:
    """How far a re-executed hidden state may differ from the delivered one. A position's error
    is ||R (h_delivered - h_recomputed)|| / ||h_recomputed||: an estimate of ||delta|| / ||h||
    (R is scaled so that E ||R x||^2 = ||x||^2), scale-free. A position fails over `max_error`.
    Subtler changes only show in the mean: over at least `mean_min_points` positions, a mean
    error over `max_mean_error` fails every position whose own error is over it.

    Calibrated on honest computation (bench/commit_sensitivity.py;
    tests/unit/trust/test_commit.py repeats it in small): KV-cache decoding of a left-padded batch of 8 rows against teacher-forced
    recomputation of the batch with 3 more padding columns, bf16 vs fp32 both ways, through the
    bf16 or the int8 activation codec on both sides (delivery and the verifier's reply), a sketch
    of 32 dims at every position, 20 secret matrices. Honest error, worst / worst mean:
    - SmolLM2-135M stage 0 (15 layers, hidden 576, 188 positions): 0.061 / 0.0125; through int8
      0.078 / 0.030.
    - a tiny test model (hidden 32, 225 positions): 0.010 / 0.0048; through int8 0.019 / 0.0076.
    Real sessions have a longer tail than that set: the demo's chat prompts with 20 sampled
    tokens, 60 groups of 8 rows (29,493 positions), bf16 decoding against fp32: exact
    ||delta|| / ||h|| p99 0.047, worst 0.106, and the 32-dim estimate of it up to 0.137 (2 of
    300 checks over 0.125); in demo runs, honest replicas were failed at single positions at
    0.15-0.16 with the per-position bound at 0.125.
    The estimate's own spread is about 1/sqrt(2 dims) = 12.5% of the error. So the per-position
    bound is 0.25, 2.7x the honest exact worst, and one position alone fails for a lie of about
    0.3x a row's std or more (bench/commit_sensitivity.py: 0.4x std at any single position every
    check); smaller lies fail through the mean. A corruption of Gaussian noise of s x a row's std
    errs by about s (x 1.1: by 0.1). The mean, 2.4x the honest worst mean, catches noise of 0.05x
    std and x 1.1 over every position or only 7 in 8 of them (every check), while 0.02x std
    passes. Through int8 the bounds are 0.3 and 0.06. The old top-k commitments at every 8th
    position caught 0.1-0.2x std at the positions they opened and nothing elsewhere."""

    max_error: float = 0.25
    max_mean_error: float = 0.03
    mean_min_points: int = 16

    @classmethod
    def for_codec(cls, codec: ActivationCodec) -> CommitTolerance:
        """The tolerance of a run whose hidden states travel in `codec`: int8 rounds them to
        1/254 of their row's largest value on the way to the coordinator and back from the
        verifier."""
        return cls(max_error=0.3, max_mean_error=0.06) if codec == "int8" else cls()


def sketch_matrix(seed: int, dims: int, hidden_size: int) -> torch.Tensor:
    """The secret Gaussian [dims, hidden_size] matrix of `seed`, scaled so that a sketch has
    about the norm of its hidden state (E ||R x||^2 = ||x||^2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(dims, hidden_size, generator=generator) / dims ** 0.5


@dataclass(frozen=True)
class Sketches:
    """Kept sketches: rows [N], position ids [N] (int64), sketches [N, dims] (SKETCH_DTYPE)."""

    rows: torch.Tensor
    positions: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.rows.numel()

    @staticmethod
    def concat(parts: Sequence[Sketches], dims: int) -> Sketches:
        """The sketches of many replies (of one session and stage) as one."""
        if not parts:
            empty = torch.zeros(0, dtype=torch.long)
            return Sketches(empty, empty, torch.zeros(0, dims, dtype=SKETCH_DTYPE))
        return Sketches(*(torch.cat([getattr(part, name) for part in parts])
                          for name in ("rows", "positions", "values")))


def take_sketches(hidden: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                  matrix: torch.Tensor) -> Sketches:
    """The sketches of a stage's delivered output `hidden` [B, T, H] at every valid entry of
    `positions` [B, T] (one reply's new positions)."""
    rows, cols = valid.nonzero(as_tuple=True)
    values = hidden[rows, cols].float() @ matrix.T
    return Sketches(rows, positions[rows, cols], values.to(SKETCH_DTYPE))


@dataclass(frozen=True)
class CommitCheck:
    checked: int  # kept positions found among the recomputed hidden states
    failed: int
    worst: float  # the largest position error (see CommitTolerance)
    mean: float  # the mean position error over the checked positions
    first_failure: tuple[int, int] | None  # (row, position) of the earliest failing position


def check_sketches(kept: Sketches, matrix: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor, valid: torch.Tensor, tolerance: CommitTolerance
                   ) -> CommitCheck:
    """Compare `kept` with recomputed hidden states [B, T, H] sketched by the same `matrix`;
    kept positions that are not valid entries of `positions` [B, T] are not checked."""
    found, cols = _locate(kept.rows, kept.positions, positions, valid)
    if not bool(found.any()):
        return CommitCheck(0, 0, 0.0, 0.0, None)
    rows, at = kept.rows[found], kept.positions[found]
    recomputed = hidden[rows, cols[found]].float()
    gap = (kept.values[found].float() - recomputed @ matrix.T).norm(dim=-1)
    # Over the recomputed state's own norm, not its sketch's: one random estimate, not two.
    error = gap / recomputed.norm(dim=-1).clamp(min=1e-12)
    failed = error > tolerance.max_error
    mean = float(error.mean())
    if len(error) >= tolerance.mean_min_points and mean > tolerance.max_mean_error:
        # The mean is over the bound only if some positions are: those fail.
        failed |= error > tolerance.max_mean_error
    first = None
    if bool(failed.any()):
        # The earliest position: where the delivery and the recomputation start to disagree.
        position, row = min(zip(at[failed].tolist(), rows[failed].tolist()))
        first = (row, position)
    return CommitCheck(len(error), int(failed.sum()), float(error.max()), mean, first)


def earliest_failure(checks: Sequence[tuple[int, CommitCheck]]) -> tuple[int, int, int] | None:
    """(stage, row, position) to blame among the (stage, check) pairs of a session: the earliest
    failing position (ties: the lower stage). A lie at stage s at position q fails stage s at q,
    and the next stage, fed the lie but re-executed on the truth, only at q and later."""
    failures = [(check.first_failure[1], stage, check.first_failure[0])
                for stage, check in checks if check.first_failure is not None]
    if not failures:
        return None
    position, stage, row = min(failures)
    return stage, row, position


def _keys(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rows.long() * MAX_POSITION + positions.long()


def _locate(rows: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor,
            valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For points (rows [N], position ids `kept` [N]): whether each is a valid entry of
    `positions` [B, T] and, where it is, its column."""
    at_rows, at_cols = valid.nonzero(as_tuple=True)
    keys, order = _keys(at_rows, positions[at_rows, at_cols]).sort()
    wanted = _keys(rows, kept)
    if len(keys) == 0:
        return torch.zeros(len(wanted), dtype=torch.bool), torch.zeros_like(wanted)
    slot = torch.searchsorted(keys, wanted).clamp(max=len(keys) - 1)
    found = keys[slot] == wanted
    return found, torch.where(found, at_cols[order[slot]], 0)
