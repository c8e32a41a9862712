"""The `train.entropy` section: what holds the policy's entropy up (learn/entropy.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from decentrl.config.base import Section


class EntropyConfig(Section):
    """Entropy control: acting on the few tokens whose log-probability and advantage covary
    most (Clip-Cov, KL-Cov), and an entropy bonus that holds a target entropy. Each composes
    with every train.loss and off-policy correction."""

    method: Literal["none", "clip_cov", "kl_cov"] = Field(
        "none", description="clip_cov: a random share (`fraction`) of the batch's tokens whose "
        "covariance of log-probability and advantage lies within `clip_cov_bounds` gets no "
        "gradient; kl_cov: the share with the largest covariance is pulled back to the "
        "proximal policy (`kl_cov_coef` x |log pi - log pi_prox|), which acts only from a "
        "batch's second optimizer step on (train.minibatches_per_batch or "
        "train.epochs_per_batch above 1); none: neither")
    fraction: float = Field(0.002, gt=0, le=1, description="the share of the batch's counted "
                            "tokens the method acts on, at least one (the paper: 2e-4 for "
                            "clip_cov, 2e-3 for kl_cov at 7B; a batch here holds a few "
                            "thousand tokens)")
    clip_cov_bounds: tuple[float, float] = Field(
        (1.0, 5.0), description="clip_cov draws among tokens whose covariance lies strictly "
        "within (low, high)")
    kl_cov_coef: float = Field(1.0, gt=0, le=100, allow_inf_nan=False, description="kl_cov's "
                               "weight on |log pi - log pi_prox| of the tokens it selects")
    target: float | None = Field(None, gt=0, le=20, description="adaptive entropy bonus: hold "
                                 "the policy's mean entropy per token at this many nats with a "
                                 "bonus -coef x H(pi), applied while the entropy is below it "
                                 "(None: no bonus)")
    coef_step: float = Field(0.005, gt=0, le=1, allow_inf_nan=False, description="the bonus's "
                             "coefficient rises by this after every optimizer step below the "
                             "target, and falls by it after every other")
    max_coef: float = Field(0.05, gt=0, le=10, allow_inf_nan=False, description="the bonus's "
                            "coefficient never exceeds this")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> EntropyConfig:
        low, high = self.clip_cov_bounds
        if not low < high:
            raise ValueError(f"clip_cov_bounds must be (low, high) with low < high, got "
                             f"{self.clip_cov_bounds}")
        return self
