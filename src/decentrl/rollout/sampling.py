"""Sampling with temperature / top-k / top-p, and the log-prob of a token under the distribution it
was actually drawn from. The trainer calls the same `sampling_logprobs`, so the importance ratio
between learner and behaviour policy is exactly 1 when the weights and numerics are the same."""

from __future__ import annotations

import math

import msgspec
import torch

from decentrl.config import RolloutConfig


class SamplingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How tokens are drawn; the same struct travels to the last stage (net/protocol.py), where
    decoding validates it before anything runs."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_config(rollout: RolloutConfig) -> SamplingConfig:
    """The sampling a run's rollouts use."""
    return SamplingConfig(rollout.temperature, rollout.top_p, rollout.top_k)


def transformed_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """fp32 logits of the distribution sampled from: scaled by temperature, -inf outside the
    top-k / top-p set. Greedy decoding is scored as temperature 1 (its log-probs are diagnostics)."""
    logits = logits.float()
    if not config.greedy and config.temperature != 1.0:
        logits = logits / config.temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token stays.
        drop_sorted = probs.cumsum(-1) - probs >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                                  config: SamplingConfig, floor: float = -1e4,
                                  entropy_gradient: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `tokens` under the transformed distribution, and that distribution's entropy
    (from the same log-softmax, which is the costly part; detached, for metrics, unless
    `entropy_gradient`: an entropy bonus). A token outside the kept set (a stale behaviour policy
    can pick one the learner would cut) gets `floor` instead of -inf, so it has no gradient and
    an off-policy weight of ~0 instead of a NaN."""
    logprobs = transformed_logits(logits, config).log_softmax(-1)
    picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp(min=floor)
    with torch.set_grad_enabled(entropy_gradient and torch.is_grad_enabled()):
        probs = logprobs.exp()
        entropy = -(probs * logprobs.masked_fill(probs == 0, 0.0)).sum(-1)
    return picked, entropy


def sampling_logprobs(logits: torch.Tensor, tokens: torch.Tensor, config: SamplingConfig,
                      floor: float = -1e4) -> torch.Tensor:
    return sampling_logprobs_and_entropy(logits, tokens, config, floor)[0]


def sampling_noise(generator: torch.Generator | None, rows: int, vocab: int) -> torch.Tensor:
    """I.i.d. Exp(1) noise [rows, vocab], float32, drawn on the CPU (None: torch's global
    generator). As -log(U) of torch.rand rather than exponential_: CPU rand is one serial
    Mersenne Twister stream on every build, while exponential_ takes MKL's generator where torch
    has MKL, so the same seed would give other noise on another machine. U = 0 (odds 2^-24) gives
    infinite noise: that token is not drawn at that step, a negligible bias."""
    uniform = torch.rand(rows, vocab, generator=generator, dtype=torch.float32)
    return -uniform.log()


def _seeded_scores(logprobs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logprob - log(noise): the argmax over a row is a draw from softmax(logprobs) (the
    exponential race, i.e. the Gumbel-max trick), and -inf stays -inf for excluded tokens. The
    log is taken on the CPU, so only the logits depend on the hardware."""
    if noise.shape != logprobs.shape:
        raise ValueError(f"noise {tuple(noise.shape)} does not match logits "
                         f"{tuple(logprobs.shape)}")
    return logprobs - noise.log().to(logprobs.device)


def sample(logits: torch.Tensor, config: SamplingConfig,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [N, vocab]; returns (tokens, behaviour log-probs). The
    draw depends only on the generator's seed and the logits, not on the device: the noise is
    drawn on the CPU, so a verifier on other hardware re-derives it (`sampling_margin`)."""
    transformed = transformed_logits(logits, config)
    logprobs = transformed.log_softmax(-1)
    if config.greedy:
        tokens = transformed.argmax(-1)
    else:
        noise = sampling_noise(generator, *logprobs.shape)
        tokens = _seeded_scores(logprobs, noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sampling_margin(logits: torch.Tensor, tokens: torch.Tensor, config: SamplingConfig,
                    noise: torch.Tensor) -> torch.Tensor:
    """How far (nats) each row's `tokens` [N] scores below the seeded draw from `logits` [N, vocab]
    with `noise` (`sampling_noise` of the step's generator): 0 when it is the draw, about the
    logits' error when a recomputation on other hardware (bf16 against fp32) moved a near tie, and
    large (+inf outside the kept set) for a token that was not drawn. Greedy ignores the noise:
    the top log-prob minus the token's."""
    logprobs = transformed_logits(logits, config).log_softmax(-1)
    scores = logprobs if config.greedy else _seeded_scores(logprobs, noise)
    picked = scores.gather(-1, tokens.unsqueeze(-1).to(scores.device)).squeeze(-1)
    return scores.max(-1).values - picked
