from __future__ import annotations

import math

import pytest
import torch

from decentrl.learn.advantages import (
    filter_zero_variance_groups,
    group_advantages,
    zero_variance_groups,
)


def test_advantages_without_std_scaling_subtract_the_group_mean():
    # group 0: [1, 0, 0, 0], mean 0.25 -> [0.75, -0.25, -0.25, -0.25]
    # group 1: [2, 2, 2, 2], mean 2    -> all 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    advantages = group_advantages(rewards, group_size=4, scale_by_std=False)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected)


def test_advantages_with_std_scaling_use_the_population_std():
    # group 0: deviations [0.75, -0.25, -0.25, -0.25];
    #   population std = sqrt((0.5625 + 3 * 0.0625) / 4) = sqrt(0.1875) = sqrt(3) / 4
    #   -> [0.75 * 4 / sqrt(3), -0.25 * 4 / sqrt(3)] = [sqrt(3), -1 / sqrt(3)]
    # group 1: zero variance -> 0 / (0 + eps) = 0 exactly
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    advantages = group_advantages(rewards, group_size=4, scale_by_std=True, eps=1e-6)
    s3 = math.sqrt(3)
    expected = torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    assert advantages[4:].eq(0).all()


def test_std_scaled_pair_is_plus_minus_one_not_the_unbiased_0_707():
    # [0, 1]: deviations [-0.5, 0.5], population std 0.5 -> [-1, 1]
    # (TRL's unbiased std would give sqrt(0.5) = 0.707 and [-0.707, 0.707]).
    advantages = group_advantages(torch.tensor([0.0, 1.0]), group_size=2, scale_by_std=True)
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)


def test_zero_variance_groups_are_detected_per_group():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert zero_variance_groups(rewards, group_size=2).tolist() == [True, False, True]


def test_drop_policy_removes_zero_variance_samples_and_counts_them():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    result = filter_zero_variance_groups(rewards, group_size=2, policy="drop")
    assert result.keep_mask.tolist() == [False, False, True, True, False, False]
    assert result.num_groups == 3
    assert result.num_zero_variance_groups == 2
    assert result.num_dropped_samples == 4


def test_keep_policy_keeps_every_sample_but_still_counts_the_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    result = filter_zero_variance_groups(rewards, group_size=2, policy="keep")
    assert result.keep_mask.tolist() == [True] * 6
    assert result.num_zero_variance_groups == 2
    assert result.num_dropped_samples == 0


@pytest.mark.parametrize(
    ("rewards", "group_size", "message"),
    [
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.tensor([1.0, float("nan")]), 2, "NaN"),
        (torch.tensor([1.0, float("inf")]), 2, "infinite"),
        (torch.zeros(5), 2, "not a multiple of group_size=2"),
        (torch.zeros(4), 1, "group_size must be an int >= 2"),
        (torch.zeros(4), 2.0, "group_size must be an int >= 2"),
        (torch.tensor([1, 0]), 2, "floating-point"),
        (torch.zeros(0), 2, "empty"),
        ([1.0, 0.0], 2, "torch.Tensor"),
    ],
)
def test_bad_rewards_are_rejected_with_the_problem_named(rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, group_size, scale_by_std=True)
    with pytest.raises(ValueError, match=message):
        zero_variance_groups(rewards, group_size)


def test_unknown_zero_variance_policy_and_bad_eps_are_rejected():
    with pytest.raises(ValueError, match="policy must be one of"):
        filter_zero_variance_groups(torch.zeros(2), 2, policy="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.zeros(2), 2, scale_by_std=True, eps=0.0)
