from __future__ import annotations

import math

import pytest

from decentrl.evaluate.stats import (
    Accuracy,
    difference_interval,
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
    assert Accuracy.from_values([0.2, 0.4, 0.6]).as_percent() == "40.0% [17.4, 62.6]"


def test_mean_scores_are_clipped_to_the_unit_interval() -> None:
    # One problem of 8 solved: mean 0.125, sample sd sqrt(8 * 0.125 * 0.875 / 7) = 0.353553, so
    # the standard error is 0.125 and the raw interval 0.125 -/+ 0.245 = [-0.12, 0.37].
    accuracy = Accuracy.from_values([1.0] + [0.0] * 7)
    assert accuracy.low == 0.0 and accuracy.high == pytest.approx(0.125 + 1.96 * 0.125)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Accuracy.from_values([0.5, 1.5])


def test_difference_interval_matches_newcombe() -> None:
    # Newcombe (1998), Table II, example (a): 56/70 vs 48/80 -> 0.2000 [0.0524, 0.3339].
    low, high = difference_interval(56, 70, 48, 80, z=1.959964)
    assert low == pytest.approx(0.0524, abs=1e-4) and high == pytest.approx(0.3339, abs=1e-4)
    # Equal proportions: an interval around 0, symmetric.
    low, high = difference_interval(30, 100, 30, 100)
    assert low == pytest.approx(-high) and low < 0 < high
