"""Entropy control: the tokens Clip-Cov and KL-Cov act on, and an adaptive entropy bonus.

Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv:2505.22617) show that, under policy gradient, the entropy a step spends follows
the covariance between a token's log-probability and its advantage, and that a few tokens with
a large covariance (already likely, and rewarded) spend most of it. Per counted token,

    cov = (log pi - mean log pi) * (A - mean A)

with both means over the batch's counted tokens. Clip-Cov takes the gradient away from a random
`fraction` of the batch's tokens among those whose cov lies strictly between `low` and `high`
(the paper: 2e-4 of the tokens, within (1, 5)); KL-Cov adds `coef * |log pi - log pi_prox|` to
the `fraction` of tokens with the largest cov (the paper: 2e-3 at 7B, coefficient 1). KL-Cov's
penalty is zero, and so is its gradient, until the learner has moved away from the proximal
policy: it acts from a batch's second update on (train.minibatches_per_batch, epochs_per_batch).

The selection is made once per batch, where the whole batch is: on the driver, from the proximal
log-probs (the learner's before the batch's first update, what the paper's current policy is at
its first update), before the first micro-batch. It reaches the last stage as a [B, C] mask
beside the proximal log-probs (learn/stage_loss.py `LossInputs.selected`), so a re-execution of a
micro-batch (trust/audit.py) selects the same tokens.

Adaptive entropy (He et al. 2025, Skywork-OR1, arXiv:2505.22312): an entropy bonus
`-coef * H(pi)` whose coefficient rises by `step` after every update whose entropy was below the
target and falls by it otherwise (never below 0, never above `max_coef`), applied only while the
entropy is below the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

CovarianceMethod = Literal["none", "clip_cov", "kl_cov"]
COVARIANCE_METHODS: tuple[str, ...] = get_args(CovarianceMethod)


def token_covariance(proximal: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """[B, C] float64: each counted token's centred product (log pi_prox - its mean) x (A - its
    mean), the means over the counted tokens (`mask`, bool [B, C]); 0 elsewhere. `advantages`
    is [B], one per sequence."""
    counted = mask.to(torch.float64)
    count = counted.sum().clamp(min=1)
    logprobs = proximal.detach().to(torch.float64) * counted
    per_token_advantage = advantages.detach().to(torch.float64)[:, None] * counted
    centred_logprobs = (logprobs - logprobs.sum() / count) * counted
    centred_advantages = (per_token_advantage - per_token_advantage.sum() / count) * counted
    return centred_logprobs * centred_advantages


def covariance_selection(proximal: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         method: CovarianceMethod, fraction: float,
                         bounds: tuple[float, float] = (1.0, 5.0),
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, C] bool: the counted tokens `method` acts on. `fraction` of the counted tokens (at
    least one, when any is counted): for kl_cov those with the largest covariance; for clip_cov
    a random draw (`generator`, on the CPU) among those whose covariance lies strictly within
    `bounds`, all of them when fewer are there."""
    if method not in COVARIANCE_METHODS:
        raise ValueError(f"method must be one of {COVARIANCE_METHODS}, got {method!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    low, high = bounds
    if not low < high:
        raise ValueError(f"bounds must be (low, high) with low < high, got {bounds}")
    mask = mask.bool()
    selected = torch.zeros_like(mask)
    total = int(mask.sum())
    if method == "none" or total == 0:
        return selected
    wanted = max(1, math.floor(fraction * total))
    covariance = token_covariance(proximal, advantages, mask)
    if method == "kl_cov":
        ranked = covariance.masked_fill(~mask, -math.inf).flatten()
        chosen = ranked.topk(wanted).indices
    else:
        candidates = (mask & (covariance > low) & (covariance < high)).flatten().nonzero()[:, 0]
        order = torch.randperm(candidates.numel(), generator=generator).to(candidates.device)
        chosen = candidates[order[:wanted]]
    flat = selected.flatten()
    flat[chosen] = True
    return flat.view_as(mask)


@dataclass
class AdaptiveEntropy:
    """The entropy bonus's coefficient, adapted to hold the policy's entropy at `target` nats per
    token (its state is `coef`, which a checkpoint keeps)."""

    target: float
    step: float
    max_coef: float
    coef: float = 0.0
    below_target: bool = False  # the last update's entropy was below the target

    def __post_init__(self) -> None:
        for name in ("target", "step", "max_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 <= self.coef <= self.max_coef:
            raise ValueError(f"coef must be in [0, max_coef={self.max_coef}], got {self.coef}")

    @property
    def applied(self) -> float:
        """The bonus's weight in the next update: 0 while the entropy is at or above target."""
        return self.coef if self.below_target else 0.0

    def update(self, entropy: float) -> None:
        """After an update whose counted tokens had mean entropy `entropy` (nats)."""
        if not math.isfinite(entropy):
            raise ValueError(f"entropy must be finite, got {entropy}")
        self.below_target = entropy < self.target
        change = self.step if self.below_target else -self.step
        self.coef = min(self.max_coef, max(0.0, self.coef + change))
