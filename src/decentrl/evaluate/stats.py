"""Confidence intervals and pass@k for evaluation tables.

Accuracy over n problems is a binomial proportion; its interval is Wilson's, which stays inside
[0, 1] and behaves at 0/n and n/n, where the normal approximation collapses to a zero-width
interval. pass@k averaged over problems is a mean of values in [0, 1], not a count of successes;
its interval is the normal approximation on the standard error of the mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Z_95 = 1.96  # two-sided 95% normal quantile


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% with the default z)."""
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
    def from_values(cls, values: Sequence[float]) -> Accuracy:
        """Mean of per-problem scores in [0, 1] (e.g. pass@k), with its normal-approximation
        interval clipped to [0, 1]: the normal approximation overshoots near the ends with few
        problems (1 of 8 solved gives -12%), and no score lies outside."""
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError("per-problem scores must lie in [0, 1]")
        mean, low, high = mean_interval(values)
        return cls(mean=mean, low=max(0.0, low), high=min(1.0, high), n=len(values))

    def as_percent(self) -> str:
        """For tables: "43.5% [38.1, 49.0]"."""
        return f"{100 * self.mean:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}]"
