"""Confidence intervals and pass@k for evaluation tables.

Accuracy over n problems is a binomial proportion; its interval is Wilson's, which stays inside
[0, 1] and behaves at 0/n and n/n, where the normal approximation collapses to a zero-width
interval. A sampled pass@1 or pass@k averaged over problems is a mean of per-problem scores in
[0, 1], each from several samples of one problem; the samples of a problem are not independent
(a problem the model cannot solve fails all of them), so its interval is Wilson's on the
effective number of independent trials behind the mean (`effective_trials`), which never
collapses either.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Z_95 = 1.96  # two-sided 95% normal quantile


def wilson_interval(successes: float, trials: float, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% with the default z). The counts may
    be fractional: an effective number of trials (`effective_trials`) and its share of successes."""
    if trials <= 0:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials={trials}], got {successes}")
    p = successes / trials
    z2_over_n = z * z / trials
    center = (p + z2_over_n / 2) / (1 + z2_over_n)
    half_width = z * math.sqrt(p * (1 - p) / trials + z2_over_n / (4 * trials)) / (1 + z2_over_n)
    # Clamp away rounding noise at the ends (0/n and n/n touch the bounds exactly in theory).
    return max(0.0, center - half_width), min(1.0, center + half_width)


def difference_interval(successes_a: int, trials_a: int, successes_b: int, trials_b: int,
                        z: float = Z_95) -> tuple[float, float]:
    """Interval for p_a - p_b of two independent proportions: Newcombe's hybrid score method
    (method 10 of Newcombe 1998), built from the two Wilson intervals. It holds 0 when the
    difference is not significant."""
    p_a, p_b = successes_a / trials_a, successes_b / trials_b
    low_a, high_a = wilson_interval(successes_a, trials_a, z)
    low_b, high_b = wilson_interval(successes_b, trials_b, z)
    difference = p_a - p_b
    return (difference - math.sqrt((p_a - low_a) ** 2 + (high_b - p_b) ** 2),
            difference + math.sqrt((high_a - p_a) ** 2 + (p_b - low_b) ** 2))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021).

    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which avoids
    the huge binomial coefficients.
    """
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def effective_trials(scores: Sequence[float], max_trials: int) -> float:
    """How many independent Bernoulli trials a mean of per-problem scores is worth: Kish's
    effective sample size, n_eff = p (1 - p) / Var(mean) = n p (1 - p) / s^2, with p the mean of
    the n scores and s^2 their sample variance (the design effect of clustering the draws into n
    problems is max_trials / n_eff).

    Clamped to [n, max_trials]. `max_trials` is what the draws would be worth were they all
    independent: the samples for a pass@1, the disjoint k-sets they make for a pass@k. n (each
    problem all-or-nothing, the intra-problem correlation 1) is the least a mean of scores in
    [0, 1] can be worth, since no score in [0, 1] with mean p varies more than a Bernoulli(p),
    p (1 - p). Where the scores do not vary (s^2 = 0), nothing measures the correlation: at p = 0
    or 1 the floor n is taken (4 problems failing all their samples are 4 trials, not the 32
    samples they hold), strictly inside it the cap."""
    n = len(scores)
    if n == 0:
        raise ValueError("effective_trials needs at least one score")
    if max_trials < n:
        raise ValueError(f"max_trials ({max_trials}) must be at least the number of problems "
                         f"({n})")
    p = statistics.fmean(scores)
    spread = statistics.variance(scores) if n > 1 else 0.0
    if spread == 0.0:
        return float(n) if p in (0.0, 1.0) else float(max_trials)
    return min(float(max_trials), max(float(n), n * p * (1 - p) / spread))


def mean_interval(values: Sequence[float], z: float = Z_95) -> tuple[float, float, float]:
    """(mean, low, high): mean -/+ z standard errors, with the sample standard deviation.

    With a single value there is no spread to estimate, and the interval is the degenerate
    (value, value, value); read it as "unknown width", not as certainty.
    """
    if len(values) == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    standard_error = statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - z * standard_error, mean + z * standard_error


@dataclass(frozen=True)
class Accuracy:
    mean: float  # in [0, 1]
    low: float
    high: float
    n: int  # problems behind the estimate

    @classmethod
    def from_counts(cls, successes: int, trials: int) -> Accuracy:
        """Fraction of problems solved, with its Wilson interval."""
        low, high = wilson_interval(successes, trials)
        return cls(mean=successes / trials, low=low, high=high, n=trials)

    @classmethod
    def from_scores(cls, scores: Sequence[float], max_trials: int) -> Accuracy:
        """Mean of per-problem scores in [0, 1] (a sampled pass@1 or pass@k; `max_trials` as
        `effective_trials` reads it), with Wilson's interval on the effective number of trials.
        Not the normal interval on the scores' standard error: that collapses to [0, 0] when
        every problem fails every sample ("0.0% [0.0, 0.0]" from 4 problems) and overshoots
        [0, 1] near the ends."""
        if not all(0.0 <= score <= 1.0 for score in scores):
            raise ValueError("per-problem scores must lie in [0, 1]")
        trials = effective_trials(scores, max_trials)
        mean = statistics.fmean(scores)
        low, high = wilson_interval(mean * trials, trials)
        return cls(mean=mean, low=low, high=high, n=len(scores))

    def as_percent(self) -> str:
        """For tables: "43.5% [38.1, 49.0]"."""
        return f"{100 * self.mean:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}]"
