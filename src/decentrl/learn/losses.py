"""Per-token policy-gradient losses (GRPO, DAPO, Dr.GRPO, GSPO, CISPO) with off-policy corrections.

Three policies score every sampled completion token (names from decoupled PPO, Hilton et al. 2022
"Batch size-invariance for policy optimization", as used by AReaL, Fu et al. 2025):

    pi      the policy being trained: `logprobs`, the only input that carries a gradient
    pi_prox the proximal policy: the learner's weights at the start of this update, i.e.
            `logprobs.detach()` when each batch gets a single optimizer step
    mu      the behaviour policy that sampled the tokens: `behaviour_logprobs`, from weights
            several versions old on a swarm worker, or the same weights under another numeric

Decoupled (`LossConfig.decoupled=True`, the default) splits the two jobs PPO's ratio usually does:
the trust region is r = pi / pi_prox, clipped, and the correction for sampling from mu is a
separate, detached weight pi_prox / mu, truncated at `tis_cap` (TIS, Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"). Sequences whose
geometric-mean pi_prox / mu falls outside [mis_low, mis_high] are masked out (sequence-level
masked importance sampling, Liu, Li et al. 2025, "When speed kills stability"); the geometric mean
makes the bound independent of length. Coupled (`decoupled=False`) is classic PPO with
pi_old := mu: the ratio is pi / mu, clipped, and there is no separate weight, so `tis_cap` is
ignored and the MIS bounds must be unset.

For large staleness, `m2_threshold` adds M2PO's second-moment mask (Zheng et al. 2025,
"Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
arXiv:2510.01161): the tokens with the largest (log r)^2, r = pi_prox / mu, leave the loss until
the mean of (log r)^2 over the tokens left is at most the threshold (0.04 in the paper). The
paper writes r = pi_theta / pi_behav; at the start of an update pi_theta is pi_prox, and fixing
the mask there for the whole batch is what AReaL's implementation does too. In either mode it
only removes tokens: with `decoupled=True` and `tis_cap=None` the kept tokens get the paper's
objective, the masked ratio pi / mu. The bound holds over the tokens one call sees, a
micro-batch: a `micro_batch_size` of the whole batch makes it the paper's per-batch bound.

`off_policy_correction=False` ignores mu (mu := pi_prox): no weight, no mask, stale tokens count
as if the learner had sampled them. It is the staleness bench's "no correction" baseline.

Entropy control (learn/entropy.py): `covariance_method` acts on the tokens the driver selected
for the whole batch (`selected`): clip_cov stops their gradient (their loss still counts in the
value), kl_cov adds `kl_cov_coef * |log pi - log pi_prox|` to each. Either composes with every
loss above and with every correction: it changes the selected tokens' term after the behaviour
weight, never the weight or the masks.

Normalisers: the loss of a micro-batch is divided by counts of the *whole* batch
(`total_sequences`, `total_tokens`), so summing the micro-batch losses gives exactly the loss, and
so the gradient, of the whole batch. Sequences masked by MIS leave the numerator only (of the
policy term and of the KL term): the normaliser stays the batch count, so the step size does not
jump when a few sequences are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from decentrl.errors import DecentrlError
from decentrl.learn.entropy import COVARIANCE_METHODS, CovarianceMethod

LossName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
LOSS_NAMES: tuple[str, ...] = get_args(LossName)
# Each sequence's token losses are averaged first, then sequences are averaged (GRPO, GSPO).
SEQUENCE_MEAN_LOSSES = ("grpo", "gspo")
# Every token of the batch weighs the same (DAPO's token-level loss, CISPO).
TOKEN_MEAN_LOSSES = ("dapo", "cispo")
# DAPO's clip-higher (Yu et al. 2025): its upper clip when none is set.
DAPO_CLIP_HIGH = 0.28


class StaleRolloutError(DecentrlError):
    """A rollout was sampled by weights older than the learner accepts."""

    def __init__(self, staleness: int, max_staleness: int) -> None:
        super().__init__(
            f"rollout is {staleness} policy versions behind the learner, "
            f"more than max_staleness={max_staleness}"
        )
        self.staleness = staleness
        self.max_staleness = max_staleness


@dataclass(frozen=True)
class LossConfig:
    """Which objective, and its clipping and off-policy knobs.

    clip_low / clip_high: PPO clip range [1 - clip_low, 1 + clip_high] on r = pi / pi_prox, for
        GRPO, Dr.GRPO and DAPO. clip_high None is the loss's own (`upper_clip`): clip_low for
        GRPO and Dr.GRPO (PPO's symmetric range), 0.28 for DAPO (clip-higher, Yu et al. 2025).
    gspo_clip_low / gspo_clip_high: the range on GSPO's length-normalised sequence ratio; its
        ratio stays near 1, hence the tiny values (Zheng et al. 2025 use 3e-4 / 4e-4).
    cispo_clip_high: eps_high^IS, CISPO's detached IS weight is min(r, 1 + cispo_clip_high).
        MiniMax-M1 (2025) sets no lower bound (eps_low^IS "large") and tunes only eps_high^IS,
        without publishing its value; 3.0 gives a cap of 4, the cap Tinker ships for CISPO.
    kl_coef: weight of the k3 KL estimate to the reference policy; > 0 needs reference_logprobs.
    tis_cap: truncation C of the per-token behaviour weight pi_prox / mu; None leaves the weight
        untruncated (plain decoupled PPO). Must be >= 1: a cap below 1 would down-weight tokens
        that are perfectly on-policy.
    mis_low / mis_high: bounds on each sequence's geometric-mean pi_prox / mu; sequences outside
        are masked. None turns that side off. They must bracket 1, else on-policy data is masked.
    dr_grpo_max_tokens: Dr.GRPO's constant normaliser (the generation budget). None uses the
        padded length T of the tensors, which differs between micro-batches padded to different
        lengths: set it whenever accumulating gradients with dr_grpo.
    decoupled: see the module docstring.
    m2_threshold: M2PO's bound tau on the mean (log pi_prox / mu)^2 of the tokens kept; None: off.
    off_policy_correction: False ignores the behaviour log-probs in the loss (see the module
        docstring); `behaviour_kl` and `behaviour_m2` still measure them.
    supervised_coef: the weight of a supervised row's negative log-likelihood beside the policy
        loss (learn/stage_loss.py `micro_batch_loss`); policy_loss itself never sees those rows.
    covariance_method / kl_cov_coef: entropy control on the tokens `policy_loss` is given as
        `selected` (see the module docstring and learn/entropy.py).
    flag_log_ratio / flag_surprise: rollouts the trainer's own log-probs expose as off-policy
        poison are left out of the loss and reported (`flagged_rows`): mean per-token
        |log pi - log mu| above flag_log_ratio (forged behaviour log-probs), or mean per-token
        log pi + H(pi) below -flag_surprise (tokens far less likely than the policy's own
        samples, whose mean is 0 in expectation: random or injected tokens). None: off.
    """

    name: LossName
    clip_low: float = 0.2
    clip_high: float | None = None
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_clip_high: float = 3.0
    kl_coef: float = 0.0
    tis_cap: float | None = 2.0
    mis_low: float | None = None
    mis_high: float | None = None
    dr_grpo_max_tokens: int | None = None
    decoupled: bool = True
    m2_threshold: float | None = None
    off_policy_correction: bool = True
    supervised_coef: float = 1.0
    flag_log_ratio: float | None = None
    flag_surprise: float | None = None
    covariance_method: CovarianceMethod = "none"
    kl_cov_coef: float = 1.0

    @property
    def upper_clip(self) -> float:
        """The clip range's upper end is 1 + this, for grpo, dr_grpo and dapo."""
        if self.clip_high is not None:
            return self.clip_high
        return DAPO_CLIP_HIGH if self.name == "dapo" else self.clip_low

    def __post_init__(self) -> None:
        if self.name not in LOSS_NAMES:
            raise ValueError(f"name must be one of {LOSS_NAMES}, got {self.name!r}")
        # A lower clip of 1 or more would allow ratios <= 0, which a probability ratio never is.
        for field_name in ("clip_low", "gspo_clip_low"):
            value = getattr(self, field_name)
            if not 0 < value < 1:
                raise ValueError(f"{field_name} must be in (0, 1), got {value}")
        for field_name in ("clip_high", "gspo_clip_high", "cispo_clip_high"):
            value = getattr(self, field_name)
            if field_name == "clip_high" and value is None:
                continue
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{field_name} must be a finite number > 0, got {value}")
        if self.covariance_method not in COVARIANCE_METHODS:
            raise ValueError(f"covariance_method must be one of {COVARIANCE_METHODS}, got "
                             f"{self.covariance_method!r}")
        if not (math.isfinite(self.kl_cov_coef) and self.kl_cov_coef > 0):
            raise ValueError(f"kl_cov_coef must be a finite number > 0, got {self.kl_cov_coef}")
        for field_name in ("kl_coef", "supervised_coef"):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field_name} must be a finite number >= 0, got {value}")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap >= 1):
            raise ValueError(f"tis_cap must be None or a finite number >= 1, got {self.tis_cap}")
        if self.mis_low is not None and not 0 < self.mis_low <= 1:
            raise ValueError(f"mis_low must be None or in (0, 1], got {self.mis_low}")
        if self.mis_high is not None and not (math.isfinite(self.mis_high) and self.mis_high >= 1):
            raise ValueError(f"mis_high must be None or a finite number >= 1, got {self.mis_high}")
        if not self.decoupled and (self.mis_low is not None or self.mis_high is not None):
            raise ValueError(
                "mis_low/mis_high need decoupled=True: coupled PPO has no separate behaviour weight"
            )
        if self.dr_grpo_max_tokens is not None and (
            isinstance(self.dr_grpo_max_tokens, bool)
            or not isinstance(self.dr_grpo_max_tokens, int)
            or self.dr_grpo_max_tokens < 1
        ):
            raise ValueError(
                f"dr_grpo_max_tokens must be None or an int >= 1, got {self.dr_grpo_max_tokens!r}"
            )
        if not isinstance(self.decoupled, bool):
            raise ValueError(f"decoupled must be a bool, got {self.decoupled!r}")
        if self.m2_threshold is not None and not (
            math.isfinite(self.m2_threshold) and self.m2_threshold > 0
        ):
            raise ValueError(
                f"m2_threshold must be None or a finite number > 0, got {self.m2_threshold}"
            )
        if not isinstance(self.off_policy_correction, bool):
            raise ValueError(
                f"off_policy_correction must be a bool, got {self.off_policy_correction!r}"
            )
        if not self.off_policy_correction and (
            self.mis_low is not None or self.mis_high is not None or self.m2_threshold is not None
        ):
            raise ValueError(
                "mis_low/mis_high/m2_threshold need off_policy_correction=True: without it the "
                "loss never looks at the behaviour log-probs they act on"
            )
        if self.flag_log_ratio is not None and not self.flag_log_ratio > 0:
            raise ValueError(f"flag_log_ratio must be None or > 0, got {self.flag_log_ratio}")
        if self.flag_surprise is not None and not self.flag_surprise > 0:
            raise ValueError(f"flag_surprise must be None or > 0, got {self.flag_surprise}")


def flagged_rows(row_surprise: torch.Tensor, row_log_ratio: torch.Tensor,
                 config: LossConfig) -> torch.Tensor:
    """[B] bool: rollouts whose tokens the current policy finds too unlikely, or whose claimed
    behaviour log-probs sit too far from the policy's (`row_surprise` / `row_log_ratio`: per-row
    means over completion tokens of log pi + H(pi) and of log pi - log mu)."""
    flagged = torch.zeros_like(row_surprise, dtype=torch.bool)
    if config.flag_log_ratio is not None:
        flagged |= row_log_ratio.abs() > config.flag_log_ratio
    if config.flag_surprise is not None:
        flagged |= row_surprise < -config.flag_surprise
    return flagged


def check_staleness(
    learner_version: int, rollout_versions: Sequence[int], max_staleness: int
) -> int:
    """How many policy versions the oldest rollout lags the learner; raises past `max_staleness`."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if len(rollout_versions) == 0:
        raise ValueError("rollout_versions is empty")
    newest = max(rollout_versions)
    if newest > learner_version:
        raise ValueError(
            f"rollout version {newest} is newer than learner version {learner_version}: "
            "no such weights exist yet"
        )
    staleness = learner_version - min(rollout_versions)
    if staleness > max_staleness:
        raise StaleRolloutError(staleness, max_staleness)
    return staleness


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    reference_logprobs: torch.Tensor | None = None,
    total_sequences: int | None = None,
    total_tokens: int | None = None,
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to minimise for one (micro-)batch, and metrics to log.

    Per-token tensors are [B, T]; `advantages` is [B], one per sequence; `mask` (bool or 0/1
    float) marks the completion tokens that count. `total_sequences` / `total_tokens` are the
    counts of the whole batch this micro-batch belongs to (None: this micro-batch's own counts).
    `selected` (bool [B, T]): the tokens `config.covariance_method` acts on, selected over the
    whole batch (learn/entropy.py `covariance_selection`); required by a method, refused without.

    Dr.GRPO (Liu et al. 2025) also drops the std scaling of advantages; that is chosen where the
    advantages are computed (`group_advantages(..., scale_by_std=False)`), not here.

    Metrics (means over counted tokens of this micro-batch): policy_loss, clip_fraction (share of
    tokens whose gradient the clip removed, or whose CISPO weight was capped), ratio_mean,
    tis_weight_mean, tis_truncated_fraction, mis_masked_fraction (share of sequences),
    m2_masked_fraction (share of tokens), cov_selected_fraction (share of tokens the entropy
    method acts on, with one), behaviour_kl (k3 estimate of KL(mu || pi_prox), how
    off-policy the batch is), behaviour_m2 (mean (log pi_prox / mu)^2, M2PO's second moment,
    before its mask), and kl (k3 to the reference) when reference_logprobs is given.
    """
    _check_inputs(
        logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, config,
        reference_logprobs, selected,
    )
    # The proximal and behaviour policies are fixed targets: no gradient may reach them.
    proximal_logprobs = proximal_logprobs.detach()
    behaviour_logprobs = behaviour_logprobs.detach()
    advantages = advantages.detach().to(logprobs.dtype)[:, None]
    mask = mask.to(logprobs.dtype)
    sequence_lengths = mask.sum(dim=1)
    normaliser = _normaliser(config, mask, sequence_lengths, total_sequences, total_tokens)

    # Log-ratios are zeroed outside the mask before exp(), so padding can never overflow into
    # inf * 0 = NaN in the loss or its gradient.
    behaviour_log_ratio = (proximal_logprobs - behaviour_logprobs) * mask
    behaviour_ratio = behaviour_log_ratio.exp()
    behaviour_kl = behaviour_ratio - 1 - behaviour_log_ratio  # k3 of KL(mu || pi_prox), zero-masked
    behaviour_m2 = _masked_mean(behaviour_log_ratio.square(), mask)
    if not config.off_policy_correction:
        behaviour_logprobs = proximal_logprobs
        behaviour_log_ratio = torch.zeros_like(behaviour_log_ratio)
        behaviour_ratio = torch.ones_like(behaviour_ratio)
    if config.decoupled:
        anchor_logprobs = proximal_logprobs
        sequence_behaviour_ratio = _sequence_mean(behaviour_log_ratio, sequence_lengths).exp()
        if config.name == "gspo":
            # GSPO corrects whole sequences: one weight per sequence, the geometric-mean ratio.
            untruncated_weight = sequence_behaviour_ratio[:, None].expand_as(mask)
        else:
            untruncated_weight = behaviour_ratio
        behaviour_weight = _truncate(untruncated_weight, config.tis_cap)
        keep_sequence = _mis_keep(sequence_behaviour_ratio, config)
    else:
        # Classic PPO with pi_old := mu: the clipped ratio itself is the off-policy correction.
        anchor_logprobs = behaviour_logprobs
        untruncated_weight = torch.ones_like(mask)
        behaviour_weight = untruncated_weight
        keep_sequence = torch.ones_like(sequence_lengths, dtype=torch.bool)
    sequence_mask = mask * keep_sequence[:, None].to(mask.dtype)
    loss_mask = sequence_mask * _m2_keep(
        behaviour_log_ratio, sequence_mask, config.m2_threshold
    ).to(mask.dtype)

    log_ratio = (logprobs - anchor_logprobs) * mask
    if config.name in ("grpo", "dr_grpo"):
        # GRPO (Shao et al. 2024) and Dr.GRPO (Liu et al. 2025): PPO's clip, symmetric unless
        # clip_high is set.
        ratio = log_ratio.exp()
        token_loss, clipped = _clipped_surrogate(
            ratio, advantages, config.clip_low, config.upper_clip
        )
    elif config.name == "dapo":
        # DAPO (Yu et al. 2025): clip-higher, a wider upper range keeps exploration tokens alive.
        ratio = log_ratio.exp()
        token_loss, clipped = _clipped_surrogate(
            ratio, advantages, config.clip_low, config.upper_clip
        )
    elif config.name == "gspo":
        # GSPO (Zheng et al. 2025): s_i = exp(mean_t log(pi / pi_prox)), clipped per sequence.
        # GSPO-token form s_it = sg(s_i) * pi_t / sg(pi_t): its value is s_i and its gradient is
        # s_i * grad log pi_t, which averaged over the tokens equals the gradient of s_i itself.
        sequence_ratio = _sequence_mean(log_ratio.detach(), sequence_lengths).exp()
        ratio = sequence_ratio[:, None] * (logprobs - logprobs.detach()).exp()
        token_loss, clipped = _clipped_surrogate(
            ratio, advantages, config.gspo_clip_low, config.gspo_clip_high
        )
    else:
        # CISPO (MiniMax-M1 2025, eq. 4): -sg(min(r, 1 + eps_high)) * A * log pi. The weight is
        # detached and capped, never zeroed, so every token keeps its gradient; no lower bound.
        ratio = log_ratio.exp()
        cap = 1 + config.cispo_clip_high
        token_loss = -ratio.detach().clamp(max=cap) * advantages * logprobs
        clipped = ratio.detach() > cap
    token_loss = token_loss * behaviour_weight
    if selected is not None and config.covariance_method == "clip_cov":
        # Clip-Cov: the selected tokens keep their value in the loss, not their gradient.
        token_loss = torch.where(selected, token_loss.detach(), token_loss)
    elif selected is not None:
        # KL-Cov: pulled back towards the proximal policy; zero (and so is its gradient) until
        # the learner has moved away from it within the batch.
        distance = (logprobs - proximal_logprobs).abs()
        token_loss = token_loss + config.kl_cov_coef * distance * selected.to(token_loss.dtype)
    loss = _reduce(token_loss, loss_mask, sequence_lengths, config.name, normaliser)

    metrics = {
        "policy_loss": loss.item(),
        "clip_fraction": _masked_mean(clipped.to(mask.dtype), loss_mask),
        "ratio_mean": _masked_mean(ratio.detach(), loss_mask),
        "tis_weight_mean": _masked_mean(behaviour_weight, loss_mask),
        "tis_truncated_fraction": _masked_mean(
            (untruncated_weight > behaviour_weight).to(mask.dtype), loss_mask
        ),
        "mis_masked_fraction": (~keep_sequence).to(mask.dtype).mean().item(),
        "m2_masked_fraction": _masked_mean(sequence_mask - loss_mask, mask),
        "behaviour_kl": _masked_mean(behaviour_kl, mask),
        "behaviour_m2": behaviour_m2,
    }
    if selected is not None:
        metrics["cov_selected_fraction"] = _masked_mean(selected.to(mask.dtype), loss_mask)
    if reference_logprobs is not None:
        # k3 estimator (Schulman 2020, "Approximating KL divergence") of KL(pi || pi_ref):
        # exp(d) - d - 1 with d = log pi_ref - log pi, >= 0 per token; unbiased for tokens
        # sampled from pi, and the usual approximation for tokens sampled from a nearby mu.
        reference_log_ratio = (reference_logprobs.detach() - logprobs) * mask
        token_kl = reference_log_ratio.exp() - reference_log_ratio - 1
        metrics["kl"] = _masked_mean(token_kl.detach(), loss_mask)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * _reduce(
                token_kl, loss_mask, sequence_lengths, config.name, normaliser
            )
    return loss, metrics


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) per token, and where it clipped."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    # Where the clipped term is strictly smaller the min selects it, and its gradient is zero.
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _truncate(weight: torch.Tensor, cap: float | None) -> torch.Tensor:
    return weight if cap is None else weight.clamp(max=cap)


def _mis_keep(sequence_ratio: torch.Tensor, config: LossConfig) -> torch.Tensor:
    keep = torch.ones_like(sequence_ratio, dtype=torch.bool)
    if config.mis_low is not None:
        keep &= sequence_ratio >= config.mis_low
    if config.mis_high is not None:
        keep &= sequence_ratio <= config.mis_high
    return keep


def _m2_keep(log_ratio: torch.Tensor, counted: torch.Tensor,
             threshold: float | None) -> torch.Tensor:
    """[B, T] bool: the `counted` tokens M2PO keeps, dropping those with the largest squared
    `log_ratio` (zero-masked) until the mean over the rest is at most `threshold`. When even the
    smallest one is above it, none is kept: the bound holds for no token but the empty set."""
    keep = counted.bool()
    if threshold is None or not keep.any():
        return keep
    # float64: a long batch's suffix sums must not drift across the threshold.
    second_moments = log_ratio.detach().to(torch.float64).square()[keep]
    ordered, order = second_moments.sort(descending=True)
    count = ordered.numel()
    # remaining_mean[i]: the mean over the tokens left after dropping the i largest (i < count).
    remaining_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(
        count, 0, -1, dtype=torch.float64, device=ordered.device
    )
    within = (remaining_mean <= threshold).nonzero()
    dropped = int(within[0]) if within.numel() else count
    kept_counted = torch.ones(count, dtype=torch.bool, device=keep.device)
    kept_counted[order[:dropped]] = False
    keep = keep.clone()
    keep[counted.bool()] = kept_counted
    return keep


def _sequence_mean(masked_values: torch.Tensor, sequence_lengths: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of already zero-masked [B, T] values; an empty sequence gives 0."""
    return masked_values.sum(dim=1) / sequence_lengths.clamp(min=1)


def _reduce(
    token_values: torch.Tensor,
    loss_mask: torch.Tensor,
    sequence_lengths: torch.Tensor,
    name: str,
    normaliser: int,
) -> torch.Tensor:
    masked = token_values * loss_mask
    if name in SEQUENCE_MEAN_LOSSES:
        # Each sequence is averaged over its own token count, MIS-masked or not.
        return _sequence_mean(masked, sequence_lengths).sum() / normaliser
    return masked.sum() / normaliser


def _normaliser(
    config: LossConfig,
    mask: torch.Tensor,
    sequence_lengths: torch.Tensor,
    total_sequences: int | None,
    total_tokens: int | None,
) -> int:
    """The whole-batch count the loss is divided by: sequences, tokens, or sequences * budget."""
    batch_sequences = mask.shape[0]
    batch_tokens = int(sequence_lengths.sum().item())
    if total_sequences is None:
        total_sequences = batch_sequences
    elif _not_count(total_sequences) or total_sequences < batch_sequences:
        raise ValueError(
            f"total_sequences must be an int >= this micro-batch's {batch_sequences} sequences, "
            f"got {total_sequences!r}"
        )
    if total_tokens is None:
        total_tokens = batch_tokens
    elif _not_count(total_tokens) or total_tokens < max(batch_tokens, 1):
        raise ValueError(
            f"total_tokens must be an int >= 1 and >= this micro-batch's {batch_tokens} mask "
            f"tokens, got {total_tokens!r}"
        )
    if config.name in SEQUENCE_MEAN_LOSSES:
        return total_sequences
    if config.name in TOKEN_MEAN_LOSSES:
        if total_tokens == 0:
            raise ValueError("mask marks no tokens: a token-mean loss needs total_tokens >= 1")
        return total_tokens
    max_tokens = config.dr_grpo_max_tokens or mask.shape[1]
    longest = int(sequence_lengths.max().item())
    if longest > max_tokens:
        raise ValueError(
            f"a sequence has {longest} mask tokens, more than dr_grpo_max_tokens={max_tokens}"
        )
    return total_sequences * max_tokens


def _not_count(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum()
    if count.item() == 0:
        return 0.0
    return ((values * mask).sum() / count).item()


def _check_inputs(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    reference_logprobs: torch.Tensor | None,
    selected: torch.Tensor | None,
) -> None:
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    if (selected is None) != (config.covariance_method == "none"):
        raise ValueError(f"covariance_method={config.covariance_method!r} needs the selected "
                         "tokens, and only it takes them" if selected is None else
                         "selected tokens were given, but covariance_method is 'none'")
    if selected is not None and (not isinstance(selected, torch.Tensor)
                                 or selected.dtype != torch.bool
                                 or selected.shape != logprobs.shape):
        raise ValueError(f"selected must be a bool tensor of shape {tuple(logprobs.shape)} like "
                         f"logprobs, got {getattr(selected, 'dtype', type(selected).__name__)} "
                         f"{tuple(getattr(selected, 'shape', ()))}")
    if config.kl_coef > 0 and reference_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} > 0 needs reference_logprobs, got None")
    per_token = {
        "logprobs": logprobs,
        "proximal_logprobs": proximal_logprobs,
        "behaviour_logprobs": behaviour_logprobs,
    }
    if reference_logprobs is not None:
        per_token["reference_logprobs"] = reference_logprobs
    for name, tensor in {**per_token, "advantages": advantages, "mask": mask}.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be 2-D [batch, tokens], got shape {tuple(logprobs.shape)}")
    for name, tensor in {**per_token, "mask": mask}.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logprobs.shape)} "
                "like logprobs"
            )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({logprobs.shape[0]},): "
            "one per sequence"
        )
    for name, tensor in {**per_token, "advantages": advantages}.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} contains NaN or infinite values")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"mask must be bool or floating-point, got dtype {mask.dtype}")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask must contain only 0 and 1")
