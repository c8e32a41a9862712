"""Group-relative advantages (GRPO, Shao et al. 2024) and what to do with groups that teach nothing.

Rewards arrive flat, ordered group by group: the `group_size` completions of prompt 0, then the
`group_size` completions of prompt 1, and so on. Each completion's advantage is its reward minus
its group's mean, the baseline that replaces PPO's value network in GRPO.

Standard-deviation convention: when scaling, we divide by the *population* std of the group
(`unbiased=False`, divide by G). The advantages of a group with any spread then have exactly unit
root-mean-square, whatever the group size. TRL and verl use the unbiased std (divide by G - 1),
which gives advantages smaller by a factor sqrt((G - 1) / G): 0.707 instead of 1.0 for G = 2.
Dr.GRPO (Liu et al. 2025) argues against std scaling altogether (it up-weights prompts that are
nearly always solved or nearly always failed), hence `scale_by_std` is a required choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

ZeroVariancePolicy = Literal["drop", "keep"]
ZERO_VARIANCE_POLICIES: tuple[str, ...] = get_args(ZeroVariancePolicy)


@dataclass(frozen=True)
class ZeroVarianceFilter:
    """Which samples stay in the batch, and the counts to log."""

    keep_mask: torch.Tensor  # [num_groups * group_size] bool, True = the sample stays in the batch
    num_groups: int
    num_zero_variance_groups: int
    num_dropped_samples: int


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = r_i - mean(group), divided by (population std(group) + eps) when `scale_by_std`.

    A group whose rewards are all equal gets advantage exactly 0 either way (0 / (0 + eps) = 0).
    """
    _check_rewards(rewards, group_size)
    if eps <= 0:
        raise ValueError(f"eps must be > 0 so zero-variance groups do not divide by 0, got {eps}")
    grouped = rewards.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        advantages = advantages / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return advantages.reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool, True where every reward in the group is identical.

    Exact equality, not a tolerance: such a group has advantage exactly 0 and so contributes
    exactly no policy gradient (DAPO's "dynamic sampling", Yu et al. 2025, filters these).
    """
    _check_rewards(rewards, group_size)
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def filter_zero_variance_groups(
    rewards: torch.Tensor, group_size: int, policy: ZeroVariancePolicy
) -> ZeroVarianceFilter:
    """Decide what happens to the samples of zero-variance groups.

    "drop": they leave the batch (keep_mask False), so they neither dilute the token/sequence
    normalisers nor cost a backward pass. "keep": they stay (keep_mask all True), contribute zero
    advantage but still count in the normalisers, which shrinks the step as the task gets easy.
    Either way the counts are returned so the fraction of uninformative groups can be logged.
    """
    if policy not in ZERO_VARIANCE_POLICIES:
        raise ValueError(f"policy must be one of {ZERO_VARIANCE_POLICIES}, got {policy!r}")
    zero_variance = zero_variance_groups(rewards, group_size)
    if policy == "drop":
        keep_mask = (~zero_variance).repeat_interleave(group_size)
    else:
        keep_mask = torch.ones_like(rewards, dtype=torch.bool)
    return ZeroVarianceFilter(
        keep_mask=keep_mask,
        num_groups=zero_variance.numel(),
        num_zero_variance_groups=int(zero_variance.sum().item()),
        num_dropped_samples=int((~keep_mask).sum().item()),
    )


def _check_rewards(rewards: torch.Tensor, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size must be an int >= 2 (a group of one has no baseline), got {group_size!r}"
        )
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or infinite values")
