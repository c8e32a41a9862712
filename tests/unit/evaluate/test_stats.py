from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from decentrl.evaluate.stats import (
    Accuracy,
    difference_interval,
    effective_trials,
    mean_interval,
    pass_at_k,
    wilson_interval,
)

# With z = 1.96 and n = 10: z^2 / n = 3.8416 / 10 = 0.38416, denominator 1 + 0.38416 = 1.38416.


def test_wilson_no_successes() -> None:
    # p = 0: center = 0.19208 / 1.38416, half width = 1.96 * sqrt(0.38416 / 40) / 1.38416, equal to
    # the center, so low = 0 and high = 2 * 0.19208 / 1.38416 = 0.277540.
    low, high = wilson_interval(0, 10)
    assert low == pytest.approx(0.0, abs=1e-4)
    assert high == pytest.approx(0.277540, abs=1e-4)


def test_wilson_half() -> None:
    # p = 0.5: center 0.5, half width = 1.96 * sqrt(0.025 + 0.009604) / 1.38416
    #   = 1.96 * 0.186022 / 1.38416 = 0.263410.
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.236590, abs=1e-4)
    assert high == pytest.approx(0.763410, abs=1e-4)


def test_wilson_all_successes_mirrors_none() -> None:
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(1 - 0.277540, abs=1e-4)
    assert high == pytest.approx(1.0, abs=1e-4)


def test_wilson_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="trials"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_pass_at_1_is_the_fraction_correct() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_5() -> None:
    # 1 - C(7, 5) / C(10, 5) = 1 - 21 / 252 = 0.916667
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))


def test_pass_at_k_edges() -> None:
    assert pass_at_k(5, 0, 2) == 0.0
    assert pass_at_k(5, 5, 2) == 1.0
    assert pass_at_k(5, 4, 2) == 1.0  # only one wrong sample: every pair holds a correct one


def test_pass_at_k_validates() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_mean_interval_by_hand() -> None:
    # mean 0.4; sample std = sqrt((0.04 + 0 + 0.04) / 2) = 0.2; standard error 0.2 / sqrt(3) =
    # 0.115470; 1.96 * 0.115470 = 0.226321.
    mean, low, high = mean_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4)
    assert low == pytest.approx(0.173679, abs=1e-5)
    assert high == pytest.approx(0.626321, abs=1e-5)


def test_mean_interval_degenerate_and_empty() -> None:
    assert mean_interval([0.7]) == (0.7, 0.7, 0.7)
    with pytest.raises(ValueError, match="mean_interval needs at least one value"):
        mean_interval([])


def test_accuracy_formatting() -> None:
    accuracy = Accuracy.from_counts(5, 10)
    assert accuracy.n == 10
    assert accuracy.as_percent() == "50.0% [23.7, 76.3]"


def test_effective_trials_by_hand() -> None:
    # p = 0.4, s^2 = 0.04: n p (1 - p) / s^2 = 3 * 0.24 / 0.04 = 18, inside [3, 30].
    assert effective_trials([0.2, 0.4, 0.6], max_trials=30) == pytest.approx(18)
    assert effective_trials([0.2, 0.4, 0.6], max_trials=12) == 12  # no more than the draws
    # All-or-nothing problems: s^2 = n p (1 - p) / (n - 1) gives n - 1, floored at n.
    assert effective_trials([1.0, 0.0, 0.0, 0.0], max_trials=32) == 4
    # Scores that do not vary: the floor at the ends, the cap inside.
    assert effective_trials([0.0] * 4, max_trials=32) == 4
    assert effective_trials([1.0] * 4, max_trials=32) == 4
    assert effective_trials([0.5] * 4, max_trials=32) == 32
    accuracy = Accuracy.from_scores([0.2, 0.4, 0.6], max_trials=30)
    assert (accuracy.low, accuracy.high) == pytest.approx(wilson_interval(0.4 * 18, 18))


def test_effective_trials_validates() -> None:
    with pytest.raises(ValueError, match="at least one score"):
        effective_trials([], max_trials=4)
    with pytest.raises(ValueError, match=r"max_trials \(3\) must be at least the number of "
                                         r"problems \(4\)"):
        effective_trials([0.5] * 4, max_trials=3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Accuracy.from_scores([0.5, 1.5], max_trials=2)


def test_sampled_interval_never_collapses_at_the_ends() -> None:
    # 4 problems x 8 samples, every sample failing: the normal interval was "0.0% [0.0, 0.0]";
    # now Wilson on 4 effective trials, whose upper bound is z^2 / (4 + z^2) = 0.489898.
    none = Accuracy.from_scores([0.0] * 4, max_trials=32)
    assert none.as_percent() == "0.0% [0.0, 49.0]"
    assert none.low == 0.0 == none.mean and none.high == pytest.approx(3.8416 / 7.8416)
    every = Accuracy.from_scores([1.0] * 4, max_trials=32)
    assert every.mean == 1.0 == every.high and every.low == pytest.approx(4 / 7.8416)
    for accuracy in (none, every):
        assert accuracy.high - accuracy.low > 0.4 and accuracy.low <= accuracy.mean <= accuracy.high


def test_sampled_interval_narrows_with_more_problems() -> None:
    for pattern in ([0.0], [1.0], [0.0, 0.25, 0.5, 1.0]):
        accuracies = [Accuracy.from_scores(pattern * copies, max_trials=8 * copies * len(pattern))
                      for copies in (4, 16, 64)]
        widths = [accuracy.high - accuracy.low for accuracy in accuracies]
        assert widths[0] > widths[1] > widths[2] > 0


def test_one_sample_per_problem_is_wilson() -> None:
    # Independent samples, one per problem: the interval is the plain Wilson interval of the count.
    for solved in (0, 1, 7, 19, 20):
        scores = [1.0] * solved + [0.0] * (20 - solved)
        assert Accuracy.from_scores(scores, max_trials=20) == Accuracy.from_counts(solved, 20)


def test_clustered_samples_widen_the_interval() -> None:
    # 8 problems x 8 samples, half the samples passing. All-or-nothing problems are 8 trials; the
    # same share spread evenly over every problem (what independent draws look like) is worth all
    # 64 samples.
    clustered = Accuracy.from_scores([1.0] * 4 + [0.0] * 4, max_trials=64)
    spread = Accuracy.from_scores([0.5] * 8, max_trials=64)
    assert (clustered.low, clustered.high) == pytest.approx(wilson_interval(4, 8))
    assert (spread.low, spread.high) == pytest.approx(wilson_interval(32, 64))


@pytest.mark.parametrize(("problems", "samples", "chance_of_problem", "true_mean"), [
    (20, 8, lambda rng: rng.betavariate(1, 1), 0.5),  # problems of every difficulty
    (40, 1, lambda rng: 0.3, 0.3),  # independent samples: Wilson's own setting
    (20, 8, lambda rng: 0.05, 0.05),  # near 0, every sample independent
    (20, 8, lambda rng: float(rng.random() < 0.1), 0.1),  # near 0, problems all-or-nothing
], ids=["uniform-difficulty", "independent", "rare-independent", "rare-all-or-nothing"])
def test_sampled_interval_covers_about_95_percent(
        problems: int, samples: int, chance_of_problem: Callable[[random.Random], float],
        true_mean: float) -> None:
    # Each run draws every problem's success chance, then its samples; the interval should hold
    # the expected chance in about 95% of runs (the normal one held it in 87-94% of them).
    rng = random.Random(0)
    runs, covered = 1000, 0
    for _ in range(runs):
        scores = [sum(rng.random() < chance for _ in range(samples)) / samples
                  for chance in (chance_of_problem(rng) for _ in range(problems))]
        accuracy = Accuracy.from_scores(scores, max_trials=problems * samples)
        covered += accuracy.low <= true_mean <= accuracy.high
    assert 0.92 <= covered / runs <= 0.98, covered / runs


def test_difference_interval_matches_newcombe() -> None:
    # Newcombe (1998), Table II, example (a): 56/70 vs 48/80 -> 0.2000 [0.0524, 0.3339].
    low, high = difference_interval(56, 70, 48, 80, z=1.959964)
    assert low == pytest.approx(0.0524, abs=1e-4) and high == pytest.approx(0.3339, abs=1e-4)
    # Equal proportions: an interval around 0, symmetric.
    low, high = difference_interval(30, 100, 30, 100)
    assert low == pytest.approx(-high) and low < 0 < high
