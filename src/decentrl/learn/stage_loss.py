"""The loss of one micro-batch at the last stage of the training chain: the run's loss config,
what the driver sends with the micro-batch (`LossInputs`), and the policy and supervised losses
with every row's statistics for the trust flags (`micro_batch_loss`). A training peer computes it
from its own logits; `completion_logprobs` is the same log-prob computation, forward only."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decentrl.config import SupervisedConfig, TrainConfig, TrustConfig
from decentrl.learn.batch import TrainBatch
from decentrl.learn.losses import LossConfig, flagged_rows, policy_loss
from decentrl.rollout.sampling import (
    SamplingConfig,
    sampling_logprobs,
    sampling_logprobs_and_entropy,
)


def loss_config_from(train: TrainConfig, max_new_tokens: int,
                     trust: TrustConfig | None = None,
                     supervised: SupervisedConfig | None = None) -> LossConfig:
    """The loss of a run; with `trust`, rollouts its flags catch stay out of the loss; with
    `supervised`, demonstrations weigh its `coef`."""
    return LossConfig(
        name=train.loss, clip_low=train.clip_low, clip_high=train.clip_high,
        kl_coef=train.kl_coef, tis_cap=train.tis_cap, mis_low=train.mis_low,
        mis_high=train.mis_high, dr_grpo_max_tokens=max_new_tokens, decoupled=train.decoupled,
        m2_threshold=train.m2_threshold, off_policy_correction=train.off_policy_correction,
        flag_log_ratio=trust.flag_log_ratio if trust else None,
        flag_surprise=trust.flag_surprise if trust else None,
        supervised_coef=supervised.coef if supervised else 1.0,
        covariance_method=train.entropy.method, kl_cov_coef=train.entropy.kl_cov_coef,
    )


# What the last stage returns per micro-batch row: the mean over its completion tokens of
# log pi + H(pi) (how much less likely than typical they are) and of log pi - log mu
# (flagged_rows turns them into poison flags).
RowStats = tuple[torch.Tensor, torch.Tensor]


# The LossInputs that are tensors, which travel beside a micro-batch to the last stage only.
LOSS_TENSORS = ("proximal", "reference", "selected")


@dataclass
class LossInputs:
    """What the last stage needs besides the micro-batch and its logits to compute the loss."""

    proximal: torch.Tensor | None  # [B, C] fixed proximal log-probs, None: the current policy's
    reference: torch.Tensor | None  # [B, C] reference log-probs for the KL term
    # Counts of the minibatch the micro-batch belongs to (loss normalisation): the policy
    # loss's sequences and tokens (TrainBatch.num_policy_sequences, num_target_tokens), and the
    # supervised rows' tokens.
    total_sequences: int
    total_tokens: int
    total_supervised_tokens: int = 0
    # Entropy control (learn/entropy.py): [B, C] bool, the tokens train.entropy.method acts on,
    # selected over the whole batch (None: no method); the adaptive entropy bonus's weight.
    selected: torch.Tensor | None = None
    entropy_coef: float = 0.0


def micro_batch_loss(logits: torch.Tensor, batch: TrainBatch, inputs: LossInputs,
                     loss: LossConfig, sampling: SamplingConfig
                     ) -> tuple[torch.Tensor, dict[str, float], RowStats]:
    """The loss of one micro-batch from the last stage's logits [N, vocab] of its targets, its
    metrics, and every row's statistics. Sampled rows get the policy loss, except those
    `flagged_rows` catches (the normalisers keep the batch's totals, so the other rows' weights
    do not change); supervised rows get `loss.supervised_coef` x their tokens' negative
    log-likelihood, summed over the minibatch's supervised tokens and divided by their count
    (`sft_nll` is the micro-batch's mean per token). A supervised row's statistics are zeros
    and it is never flagged: it is the coordinator's own demonstration."""
    valid = batch.completion_valid
    picked, entropy = sampling_logprobs_and_entropy(logits, batch.completions[valid], sampling,
                                                    entropy_gradient=inputs.entropy_coef > 0)
    logprobs = torch.zeros(valid.shape, dtype=torch.float32, device=logits.device)
    logprobs = logprobs.masked_scatter(valid, picked)
    # Only the tokens the model sampled count: an environment's tokens are context (they were
    # scored above with the rest, one forward pass) with no behaviour log-prob to compare with.
    supervised = batch.supervised
    mask = batch.completion_generated
    policy_mask = mask & ~supervised[:, None]
    with torch.no_grad():
        lengths = mask.sum(1).clamp(min=1)
        surprise = torch.zeros(valid.shape, device=logits.device).masked_scatter(
            valid, picked + entropy)
        row_surprise = (surprise * policy_mask).sum(1) / lengths
        row_log_ratio = ((logprobs - batch.behaviour_logprobs) * policy_mask).sum(1) / lengths
        flagged = flagged_rows(row_surprise, row_log_ratio, loss) & ~supervised
    value = logprobs.new_zeros(())
    metrics: dict[str, float] = {}
    policy = ~supervised
    if bool(policy.any()):
        counted = (policy_mask & ~flagged[:, None])[policy]
        value, metrics = policy_loss(
            logprobs[policy],
            (inputs.proximal if inputs.proximal is not None else logprobs.detach())[policy],
            batch.behaviour_logprobs[policy], batch.advantages[policy], counted, loss,
            reference_logprobs=None if inputs.reference is None else inputs.reference[policy],
            total_sequences=inputs.total_sequences, total_tokens=inputs.total_tokens,
            selected=None if inputs.selected is None else inputs.selected[policy])
        metrics["entropy"] = float(entropy[policy_mask[valid]].detach().mean())
        if inputs.entropy_coef > 0:
            # The adaptive bonus: -coef x the counted tokens' entropy, a token mean over the
            # minibatch's policy tokens whatever the loss (learn/entropy.py).
            counted_entropy = entropy[(policy_mask & ~flagged[:, None])[valid]].sum()
            value = value - inputs.entropy_coef * counted_entropy / inputs.total_tokens
        metrics["flagged_fraction"] = float(flagged[policy].float().mean())
    if bool(supervised.any()):
        supervised_mask = mask & supervised[:, None]
        tokens = int(supervised_mask.sum())
        if not tokens <= inputs.total_supervised_tokens:
            raise ValueError(f"total_supervised_tokens must be at least this micro-batch's "
                             f"{tokens} supervised tokens, got {inputs.total_supervised_tokens}")
        nll = -(logprobs * supervised_mask).sum()
        value = value + loss.supervised_coef * nll / inputs.total_supervised_tokens
        metrics["sft_nll"] = float(nll.detach()) / max(tokens, 1)
        metrics["sft_token_accuracy"] = float(
            (logits.detach().argmax(-1) == batch.completions[valid])[supervised_mask[valid]]
            .float().mean())
    return value, metrics, (row_surprise, row_log_ratio)


def completion_logprobs(logits: torch.Tensor, batch: TrainBatch, sampling: SamplingConfig
                        ) -> torch.Tensor:
    """[B, C] float32: the sampling-transformed log-prob of every completion target from the last
    stage's `logits` [N, vocab] (stage_forward's), 0 past a row's end: what `micro_batch_loss`
    scores as the current policy's log-probs, computed the same way."""
    valid = batch.completion_valid
    picked = sampling_logprobs(logits, batch.completions[valid], sampling)
    out = torch.zeros(valid.shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(valid, picked.float())
