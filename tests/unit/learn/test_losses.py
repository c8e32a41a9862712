from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from decentrl.learn.losses import (
    LOSS_NAMES,
    LossConfig,
    StaleRolloutError,
    check_staleness,
    policy_loss,
)

F64 = torch.float64


def log(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64).log()


def run(config, logprobs, proximal, behaviour, advantages, mask, **kwargs):
    """policy_loss on a fresh leaf copy of `logprobs`: (loss, d loss / d logprobs, metrics)."""
    logprobs = logprobs.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs, proximal, behaviour, torch.tensor(advantages, dtype=F64), mask, config, **kwargs
    )
    loss.backward()
    return loss.item(), logprobs.grad, metrics


# Shared two-sequence batch for the PPO-clip losses. pi_prox = mu, so the behaviour weight is 1.
# ratios r = pi / pi_prox:
#   sequence 0, A = +1, 2 tokens: r = [1.1, 1.5]      (third position is padding, r = 7 there)
#   sequence 1, A = -2, 3 tokens: r = [0.5, 1.1, 1.0]
PROXIMAL = log([[0.5, 0.2, 0.1], [0.4, 0.5, 0.3]])
RATIOS = [[1.1, 1.5, 7.0], [0.5, 1.1, 1.0]]
LOGPROBS = PROXIMAL + log(RATIOS)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
ADVANTAGES = [1.0, -2.0]


def test_grpo_value_and_gradient_by_hand():
    # symmetric clip [0.8, 1.2]; token loss -min(r A, clip(r) A):
    #   seq 0 (A=+1): r=1.1 -> -1.1 (unclipped);  r=1.5 -> -min(1.5, 1.2) = -1.2 (clipped)
    #   seq 1 (A=-2): r=0.5 -> -min(-1.0, -1.6) = 1.6 (clipped); r=1.1 -> 2.2; r=1.0 -> 2.0
    # sequence means: -2.3 / 2 = -1.15 and 5.8 / 3; loss = (-1.15 + 5.8 / 3) / 2
    config = LossConfig(name="grpo")
    loss, grad, metrics = run(config, LOGPROBS, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)
    assert loss == pytest.approx((-1.15 + 5.8 / 3) / 2)
    # unclipped token: d loss / d logprob = -A * r * w / (len * B); clipped tokens get 0
    expected_grad = torch.tensor(
        [[-1 * 1.1 / (2 * 2), 0.0, 0.0], [0.0, 2 * 1.1 / (3 * 2), 2 * 1.0 / (3 * 2)]], dtype=F64
    )
    torch.testing.assert_close(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 1.1 + 1.0) / 5)
    assert metrics["tis_weight_mean"] == pytest.approx(1.0)


def test_dapo_clips_higher_and_takes_the_token_mean():
    # clip [0.8, 1.28]: seq 0: -1.1, -min(1.5, 1.28) = -1.28 (clipped); seq 1: 1.6, 2.2, 2.0
    # token mean over 5 tokens: (-1.1 - 1.28 + 1.6 + 2.2 + 2.0) / 5 = 3.42 / 5
    config = LossConfig(name="dapo")
    loss, grad, metrics = run(config, LOGPROBS, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)
    assert loss == pytest.approx(3.42 / 5)
    expected_grad = torch.tensor(
        [[-1 * 1.1 / 5, 0.0, 0.0], [0.0, 2 * 1.1 / 5, 2 * 1.0 / 5]], dtype=F64
    )
    torch.testing.assert_close(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


def test_every_ppo_clipped_loss_takes_an_upper_clip_of_its_own():
    # clip [0.8, 1.3]: seq 0's r = 1.5 is clipped at 1.3 instead of 1.2; seq 1's r = 0.5 at the
    # lower bound as before. grpo: (-1.1 - 1.3) / 2 and 5.8 / 3 per sequence.
    assert LossConfig(name="grpo").upper_clip == 0.2  # PPO's symmetric range
    assert LossConfig(name="dapo").upper_clip == 0.28  # clip-higher
    loss, _, _ = run(LossConfig(name="grpo", clip_high=0.3), LOGPROBS, PROXIMAL, PROXIMAL,
                     ADVANTAGES, MASK)
    assert loss == pytest.approx((-2.4 / 2 + 5.8 / 3) / 2)
    # A stronger clip on the low side: [0.95, 1.2] clips seq 1's r = 0.5 at 0.95 (1.9).
    loss, _, metrics = run(LossConfig(name="dr_grpo", clip_low=0.05, clip_high=0.2,
                                      dr_grpo_max_tokens=3), LOGPROBS, PROXIMAL, PROXIMAL,
                           ADVANTAGES, MASK)
    assert loss == pytest.approx((-1.1 - 1.2 + 1.9 + 2.2 + 2.0) / 6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


def test_dr_grpo_divides_the_token_sum_by_sequences_times_budget():
    # GRPO's token losses: -1.1, -1.2, 1.6, 2.2, 2.0 -> sum 3.5; normaliser B * max_tokens = 2 * 4
    config = LossConfig(name="dr_grpo", dr_grpo_max_tokens=4)
    loss, grad, _ = run(config, LOGPROBS, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)
    assert loss == pytest.approx(3.5 / 8)
    expected_grad = torch.tensor([[-1.1 / 8, 0.0, 0.0], [0.0, 2.2 / 8, 2.0 / 8]], dtype=F64)
    torch.testing.assert_close(grad, expected_grad)
    # without a budget the padded length T = 3 is the constant
    loss_t, _, _ = run(LossConfig(name="dr_grpo"), LOGPROBS, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)
    assert loss_t == pytest.approx(3.5 / 6)


def test_gspo_sequence_ratio_value_and_gradient_by_hand():
    # clip [1 - 3e-4, 1 + 4e-4] on s_i = exp(mean_t log r_t):
    #   seq 0, A = +2, log r = [3e-4, -1e-4]         -> s = e^(1e-4) inside: L = -2 e^(1e-4)
    #   seq 1, A = -1, log r = [-2e-3, 0, -1e-3]     -> s = e^(-1e-3) = 0.9990 < 0.9997:
    #          -min(-0.9990, -0.9997) = 0.9997 (clipped, no gradient)
    # padding (log r = 5) must not enter the mean.
    proximal = log([[0.5, 0.2, 0.1], [0.4, 0.5, 0.3]])
    log_ratio = torch.tensor([[3e-4, -1e-4, 5.0], [-2e-3, 0.0, -1e-3]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    config = LossConfig(name="gspo")
    loss, grad, metrics = run(config, proximal + log_ratio, proximal, proximal, [2.0, -1.0], mask)
    s0 = math.exp(1e-4)
    assert loss == pytest.approx((-2 * s0 + 0.9997) / 2)
    # d L_0 / d logprob_t = -A * s_0 / len_0, then / B: -2 * s0 / (2 * 2) per token
    expected_grad = torch.tensor([[-s0 / 2, -s0 / 2, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(3 / 5)  # all 3 tokens of seq 1


def test_gspo_behaviour_weight_is_the_truncated_geometric_mean_per_sequence():
    # log(pi_prox / mu) = [log 9, 0] -> geometric mean 3 -> truncated to tis_cap = 2 for both
    # tokens; r = 1, A = 1, one sequence: L = -1 * 1 * 2 = -2, each token's gradient -2 / 2.
    proximal = log([[0.9, 0.5]])
    behaviour = log([[0.1, 0.5]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, metrics = run(LossConfig(name="gspo"), proximal, proximal, behaviour, [1.0], mask)
    assert loss == pytest.approx(-2.0)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0]], dtype=F64))
    assert metrics["tis_truncated_fraction"] == pytest.approx(1.0)


def test_cispo_value_and_gradient_by_hand():
    # cap 1 + cispo_clip_high = 4; L_t = -min(r, 4) * A * log pi_t, token mean over 3 tokens:
    #   seq 0, A = +1: pi = 0.5,  pi_prox = 1/3  -> r = 1.5 (kept)
    #                  pi = 0.25, pi_prox = 0.05 -> r = 5 -> capped at 4
    #   seq 1, A = -1: pi = 0.1, pi_prox = 0.2  -> r = 0.5 (no lower bound)
    logprobs = log([[0.5, 0.25], [0.1, 0.3]])
    proximal = log([[1 / 3, 0.05], [0.2, 0.3]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    config = LossConfig(name="cispo")
    loss, grad, metrics = run(config, logprobs, proximal, proximal, [1.0, -1.0], mask)
    expected = -(1.5 * math.log(0.5) + 4 * math.log(0.25) - 0.5 * math.log(0.1)) / 3
    assert loss == pytest.approx(expected)
    # the weight is detached: d L / d log pi_t = -min(r, 4) * A / N, never 0 (clipped or not)
    expected_grad = torch.tensor([[-1.5 / 3, -4 / 3], [0.5 / 3, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_tis_truncates_the_behaviour_weight_at_the_cap():
    # pi_prox / mu = [3, 1.5] -> w = [min(3, 2), 1.5] = [2, 1.5]; r = 1, A = 1, one sequence:
    # GRPO L = -(2 + 1.5) / 2 = -1.75; gradient -A * r * w / (len * B) = [-1, -0.75]
    proximal = log([[0.6, 0.3]])
    behaviour = log([[0.2, 0.2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, grad, metrics = run(LossConfig(name="grpo"), proximal, proximal, behaviour, [1.0], mask)
    assert loss == pytest.approx(-1.75)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -0.75]], dtype=F64))
    assert metrics["tis_weight_mean"] == pytest.approx(1.75)
    assert metrics["tis_truncated_fraction"] == pytest.approx(0.5)
    # tis_cap=None: the plain decoupled-PPO weight, w = [3, 1.5] -> L = -2.25
    untruncated, _, _ = run(
        LossConfig(name="grpo", tis_cap=None), proximal, proximal, behaviour, [1.0], mask
    )
    assert untruncated == pytest.approx(-2.25)


def test_mis_masks_whole_sequences_but_keeps_the_batch_normaliser():
    # geometric-mean pi_prox / mu: seq 0 = 2 (> mis_high = 1.5: masked); seq 1 = sqrt(1.1 / 1.1) = 1
    # seq 1 token weights [1.1, 1 / 1.1]; r = 1, A = 1 -> mean -(1.1 + 1 / 1.1) / 2, then / B = 2
    proximal = log([[0.6, 0.4], [0.55, 0.5]])
    behaviour = log([[0.3, 0.2], [0.5, 0.55]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    config = LossConfig(name="grpo", mis_low=0.5, mis_high=1.5)
    loss, grad, metrics = run(config, proximal, proximal, behaviour, [1.0, 1.0], mask)
    assert loss == pytest.approx(-(1.1 + 1 / 1.1) / 2 / 2)
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, 0.0], [-1.1 / 4, -1 / 1.1 / 4]], dtype=F64)
    )
    assert metrics["mis_masked_fraction"] == pytest.approx(0.5)
    # the low side: a sequence whose ratio is 0.5 falls under mis_low = 0.6
    low = LossConfig(name="grpo", mis_low=0.6)
    _, grad_low, metrics_low = run(low, behaviour, behaviour, proximal, [1.0, 1.0], mask)
    assert metrics_low["mis_masked_fraction"] == pytest.approx(0.5)
    assert grad_low[0].eq(0).all() and grad_low[1].ne(0).all()


# M2PO batch: per token log r = log pi_prox / mu, so (log r)^2 is
#   sequence 0 (3 tokens, then padding whose huge ratio must not count): 0.01, 1.0, 0.01
#   sequence 1 (4 tokens):                                               0.25, 0.01, 0, 0.01
# Sorted: 1.0, 0.25, 0.01 x 3, 0. Mean of all 1.29 / 7; without the 1.0: 0.29 / 6 = 0.048, still
# above tau = 0.04; without the 0.25 too: 0.04 / 5 = 0.008. So exactly those two tokens go.
M2_LOG_RATIOS = torch.tensor([[0.1, -1.0, 0.1, 9.0], [0.5, -0.1, 0.0, 0.1]], dtype=F64)
M2_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
M2_PROXIMAL = log([[0.5, 0.2, 0.1, 0.3], [0.4, 0.5, 0.3, 0.2]])


def test_m2po_masks_exactly_the_largest_second_moments():
    behaviour = M2_PROXIMAL - M2_LOG_RATIOS
    config = LossConfig(name="grpo", tis_cap=None, m2_threshold=0.04)
    loss, grad, metrics = run(config, M2_PROXIMAL, M2_PROXIMAL, behaviour, [1.0, 1.0], M2_MASK)
    # r = 1, A = 1, untruncated weights w = exp(log r): each kept token's loss is -w, divided by
    # its sequence's length and the 2 sequences; the two outliers get no gradient at all.
    weights = M2_LOG_RATIOS.exp()
    kept = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=F64)
    lengths = torch.tensor([[3.0], [4.0]], dtype=F64)
    expected_grad = -weights * kept / lengths / 2
    torch.testing.assert_close(grad, expected_grad)
    assert loss == pytest.approx(float(expected_grad.sum()))
    assert metrics["m2_masked_fraction"] == pytest.approx(2 / 7)
    assert metrics["behaviour_m2"] == pytest.approx(1.29 / 7)


def test_m2po_changes_nothing_within_the_bound():
    # On-policy data (mu = pi_prox) has second moment 0; slightly stale data under tau too.
    for behaviour in (PROXIMAL, PROXIMAL - 0.1 * MASK):
        plain = run(LossConfig(name="grpo"), LOGPROBS, PROXIMAL, behaviour, ADVANTAGES, MASK)
        masked = run(LossConfig(name="grpo", m2_threshold=0.04), LOGPROBS, PROXIMAL, behaviour,
                     ADVANTAGES, MASK)
        assert masked[0] == pytest.approx(plain[0])
        torch.testing.assert_close(masked[1], plain[1])
        assert masked[2]["m2_masked_fraction"] == 0.0


def test_m2po_keeps_no_token_when_every_one_is_over_the_bound():
    behaviour = M2_PROXIMAL - 0.5 * M2_MASK  # (log r)^2 = 0.25 > 0.1 everywhere
    config = LossConfig(name="grpo", m2_threshold=0.1)
    loss, grad, metrics = run(config, M2_PROXIMAL, M2_PROXIMAL, behaviour, [1.0, 1.0], M2_MASK)
    assert loss == 0.0 and grad.eq(0).all()
    assert metrics["m2_masked_fraction"] == 1.0


@pytest.mark.parametrize("decoupled", [True, False])
def test_without_off_policy_correction_stale_tokens_count_as_on_policy(decoupled):
    stale = PROXIMAL - log([[3.0, 0.5, 1.0], [2.0, 1.0, 0.25]])
    config = LossConfig(name="grpo", decoupled=decoupled, off_policy_correction=False)
    loss, grad, metrics = run(config, LOGPROBS, PROXIMAL, stale, ADVANTAGES, MASK)
    on_policy = run(LossConfig(name="grpo"), LOGPROBS, PROXIMAL, PROXIMAL, ADVANTAGES, MASK)
    assert loss == pytest.approx(on_policy[0])
    torch.testing.assert_close(grad, on_policy[1])
    assert metrics["tis_weight_mean"] == 1.0
    # What the loss ignored is still measured.
    assert metrics["behaviour_kl"] > 0.05 and metrics["behaviour_m2"] > 0.3


def test_k3_kl_value_and_gradient():
    # d = log pi_ref - log pi: token 0: log(0.25 / 0.5) = -ln 2 -> 0.5 + ln 2 - 1 = ln 2 - 0.5
    #                          token 1: log(1.0 / 0.5)  = +ln 2 -> 2 - ln 2 - 1  = 1 - ln 2
    # sum = 0.5 exactly; A = 0 so the policy term is 0; token mean * kl_coef: 0.1 * 0.5 / 2
    logprobs = log([[0.5, 0.5]])
    reference = log([[0.25, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    config = LossConfig(name="dapo", kl_coef=0.1)
    loss, grad, metrics = run(
        config, logprobs, logprobs, logprobs, [0.0], mask, reference_logprobs=reference
    )
    assert loss == pytest.approx(0.025)
    assert metrics["kl"] == pytest.approx(0.25)
    # d k3 / d log pi = 1 - exp(d): [1 - 0.5, 1 - 2] = [0.5, -1]; times 0.1 / 2
    torch.testing.assert_close(grad, torch.tensor([[0.025, -0.05]], dtype=F64))


def test_kl_coef_without_reference_is_an_error():
    with pytest.raises(ValueError, match="reference_logprobs"):
        policy_loss(
            LOGPROBS, PROXIMAL, PROXIMAL, torch.tensor(ADVANTAGES, dtype=F64), MASK,
            LossConfig(name="grpo", kl_coef=0.1),
        )


def test_decoupled_and_coupled_ppo_differ_when_the_behaviour_policy_is_stale():
    # pi = pi_prox = 0.5, mu = 0.25, A = 1, one token.
    # decoupled: r = pi / pi_prox = 1 (unclipped), w = min(0.5 / 0.25, 2) = 2 -> L = -2, grad -2
    # coupled:   r = pi / mu = 2 -> clipped at 1.2 -> L = -1.2, no gradient
    logprobs = log([[0.5]])
    behaviour = log([[0.25]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, grad, _ = run(LossConfig(name="grpo"), logprobs, logprobs, behaviour, [1.0], mask)
    assert loss == pytest.approx(-2.0)
    assert grad.item() == pytest.approx(-2.0)
    coupled = LossConfig(name="grpo", decoupled=False)
    loss, grad, metrics = run(coupled, logprobs, logprobs, behaviour, [1.0], mask)
    assert loss == pytest.approx(-1.2)
    assert grad.item() == 0.0
    assert metrics["clip_fraction"] == 1.0
    assert metrics["tis_weight_mean"] == 1.0


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_ratio_one_gives_the_reinforce_with_baseline_gradient(name):
    # pi = pi_prox = mu: every loss is REINFORCE with a baseline, gradient -A_i / normaliser:
    # per-sequence means (grpo, gspo): len_i * B; token means (dapo, cispo): N; dr_grpo: B * T
    logprobs = log([[0.5, 0.2, 0.1], [0.4, 0.5, 0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    _, grad, _ = run(LossConfig(name=name), logprobs, logprobs, logprobs, [1.5, -0.5], mask)
    per_token = {
        "grpo": [[2 * 2] * 3, [3 * 2] * 3],
        "gspo": [[2 * 2] * 3, [3 * 2] * 3],
        "dapo": [[5] * 3, [5] * 3],
        "cispo": [[5] * 3, [5] * 3],
        "dr_grpo": [[2 * 3] * 3, [2 * 3] * 3],
    }[name]
    advantages = torch.tensor([[1.5], [-0.5]], dtype=F64)
    expected = -advantages / torch.tensor(per_token, dtype=F64) * MASK
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_two_micro_batches_sum_to_the_whole_batch(name, decoupled):
    generator = torch.Generator().manual_seed(0)
    batch, length = 4, 6
    proximal = -torch.rand(batch, length, generator=generator, dtype=F64) * 3 - 0.1
    logprobs = proximal + torch.randn(batch, length, generator=generator, dtype=F64) * 0.3
    behaviour = proximal + torch.randn(batch, length, generator=generator, dtype=F64) * 0.5
    reference = proximal + torch.randn(batch, length, generator=generator, dtype=F64) * 0.2
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=F64)
    lengths = torch.tensor([6, 2, 4, 5])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    # geometric-mean pi_prox / mu per sequence is [0.93, 1.21, 0.98, 1.19]: MIS masks sequence 1
    mis = {"mis_low": 0.9, "mis_high": 1.19} if decoupled else {}
    config = LossConfig(name=name, kl_coef=0.05, decoupled=decoupled, dr_grpo_max_tokens=8, **mis)
    whole = logprobs.clone().requires_grad_(True)
    whole_loss, whole_metrics = policy_loss(
        whole, proximal, behaviour, advantages, mask, config, reference_logprobs=reference
    )
    whole_loss.backward()
    assert whole_metrics["mis_masked_fraction"] == (0.25 if decoupled else 0.0)

    split = logprobs.clone().requires_grad_(True)
    summed = torch.zeros((), dtype=F64)
    for rows in (slice(0, 2), slice(2, 4)):
        loss, _ = policy_loss(
            split[rows], proximal[rows], behaviour[rows], advantages[rows], mask[rows], config,
            reference_logprobs=reference[rows],
            total_sequences=batch,
            total_tokens=int(mask.sum()),
        )
        loss.backward()
        summed = summed + loss.detach()
    torch.testing.assert_close(summed, whole_loss.detach())
    torch.testing.assert_close(split.grad, whole.grad)
    assert whole.grad.abs().sum() > 0


# Entropy control on selected tokens (learn/entropy.py selects them; here: what the loss does).
SELECTED = torch.tensor([[True, False, False], [False, True, False]])


def _stale_batch(name: str, decoupled: bool):
    generator = torch.Generator().manual_seed(3)
    proximal = -torch.rand(2, 3, generator=generator, dtype=F64) * 2 - 0.1
    # GSPO's sequence clip is 3e-4 wide: moves of 0.1 would clip (and zero) every gradient.
    moved = 1e-5 if name == "gspo" else 0.1
    logprobs = proximal + torch.randn(2, 3, generator=generator, dtype=F64) * moved
    behaviour = proximal + torch.randn(2, 3, generator=generator, dtype=F64) * 2 * moved
    config = LossConfig(name=name, decoupled=decoupled, dr_grpo_max_tokens=3,
                        m2_threshold=None if not decoupled else 1.0)
    return logprobs, proximal, behaviour, config


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_clip_cov_stops_the_gradient_of_the_selected_tokens_only(name, decoupled):
    logprobs, proximal, behaviour, config = _stale_batch(name, decoupled)
    base_loss, base_grad, _ = run(config, logprobs, proximal, behaviour, ADVANTAGES, MASK)
    clip_cov = replace(config, covariance_method="clip_cov")
    loss, grad, metrics = run(clip_cov, logprobs, proximal, behaviour, ADVANTAGES, MASK,
                              selected=SELECTED)
    assert loss == pytest.approx(base_loss)  # the value counts; only the gradient is stopped
    assert grad[SELECTED].abs().sum() == 0 and base_grad[SELECTED].abs().sum() > 0
    torch.testing.assert_close(grad[~SELECTED], base_grad[~SELECTED])
    assert metrics["cov_selected_fraction"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_kl_cov_pulls_the_selected_tokens_back_to_the_proximal_policy(name, decoupled):
    logprobs, proximal, behaviour, config = _stale_batch(name, decoupled)
    kl_cov = replace(config, covariance_method="kl_cov", kl_cov_coef=0.5)
    # At the proximal policy (a batch's first update) it adds nothing, gradient included.
    at_prox = run(config, proximal, proximal, behaviour, ADVANTAGES, MASK)
    with_kl = run(kl_cov, proximal, proximal, behaviour, ADVANTAGES, MASK, selected=SELECTED)
    assert with_kl[0] == pytest.approx(at_prox[0])
    torch.testing.assert_close(with_kl[1], at_prox[1])
    # Moved away: each selected token gets coef * sign(log pi - log pi_prox) / its normaliser
    # more gradient, and the loss coef * |log pi - log pi_prox| / normaliser more value.
    base_loss, base_grad, _ = run(config, logprobs, proximal, behaviour, ADVANTAGES, MASK)
    loss, grad, _ = run(kl_cov, logprobs, proximal, behaviour, ADVANTAGES, MASK,
                        selected=SELECTED)
    normaliser = {"grpo": [[2 * 2], [3 * 2]], "gspo": [[2 * 2], [3 * 2]], "dapo": [[5], [5]],
                  "cispo": [[5], [5]], "dr_grpo": [[2 * 3], [2 * 3]]}[name]
    weight = SELECTED / torch.tensor(normaliser, dtype=F64)
    distance = (logprobs - proximal).abs()
    assert loss == pytest.approx(base_loss + 0.5 * float((distance * weight).sum()))
    torch.testing.assert_close(grad - base_grad, 0.5 * (logprobs - proximal).sign() * weight)


@pytest.mark.parametrize(
    ("method", "selected", "message"),
    [
        ("clip_cov", None, "needs the selected tokens"),
        ("none", SELECTED, "covariance_method is 'none'"),
        ("kl_cov", SELECTED.double(), "selected must be a bool tensor"),
        ("kl_cov", SELECTED[:, :2], "selected must be a bool tensor of shape"),
    ],
)
def test_entropy_control_inputs_are_checked(method, selected, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(config=LossConfig(name="grpo", covariance_method=method), selected=selected)


def test_staleness_within_the_bound_is_returned():
    assert check_staleness(10, [8, 9, 10], max_staleness=2) == 2
    assert check_staleness(5, [5], max_staleness=0) == 0


def test_staleness_past_the_bound_raises_stale_rollout_error():
    with pytest.raises(StaleRolloutError, match="3 policy versions behind") as error:
        check_staleness(10, [7, 10], max_staleness=2)
    assert error.value.staleness == 3 and error.value.max_staleness == 2


def test_rollout_from_the_future_and_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="rollout version 11 is newer than learner version 10"):
        check_staleness(10, [9, 11], max_staleness=5)
    with pytest.raises(ValueError, match="rollout_versions is empty"):
        check_staleness(10, [], max_staleness=5)
    with pytest.raises(ValueError, match="max_staleness"):
        check_staleness(10, [10], max_staleness=-1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "ppo"}, "name must be one of"),
        ({"name": "grpo", "clip_low": 1.5}, "clip_low"),
        ({"name": "grpo", "clip_high": 0.0}, "clip_high"),
        ({"name": "gspo", "gspo_clip_low": 0.0}, "gspo_clip_low"),
        ({"name": "cispo", "cispo_clip_high": -1.0}, "cispo_clip_high"),
        ({"name": "grpo", "kl_coef": -0.1}, "kl_coef"),
        ({"name": "grpo", "tis_cap": 0.5}, "tis_cap"),
        ({"name": "grpo", "mis_low": 1.2}, "mis_low"),
        ({"name": "grpo", "mis_high": 0.9}, "mis_high"),
        ({"name": "grpo", "mis_high": 2.0, "decoupled": False}, "need decoupled=True"),
        ({"name": "dr_grpo", "dr_grpo_max_tokens": 0}, "dr_grpo_max_tokens"),
        ({"name": "grpo", "m2_threshold": 0.0}, "m2_threshold"),
        ({"name": "grpo", "m2_threshold": math.inf}, "m2_threshold"),
        ({"name": "grpo", "m2_threshold": 0.04, "off_policy_correction": False},
         "need off_policy_correction=True"),
        ({"name": "grpo", "mis_low": 0.5, "off_policy_correction": False},
         "need off_policy_correction=True"),
    ],
)
def test_bad_config_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields)


def _bad_call(**overrides):
    arguments = {
        "logprobs": LOGPROBS,
        "proximal_logprobs": PROXIMAL,
        "behaviour_logprobs": PROXIMAL,
        "advantages": torch.tensor(ADVANTAGES, dtype=F64),
        "mask": MASK,
        "config": LossConfig(name="grpo"),
    }
    arguments.update(overrides)
    policy_loss(**arguments)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"logprobs": LOGPROBS[0]}, "logprobs must be 2-D"),
        ({"proximal_logprobs": PROXIMAL[:, :2]}, "proximal_logprobs has shape"),
        ({"behaviour_logprobs": PROXIMAL * float("nan")}, "behaviour_logprobs contains NaN"),
        ({"reference_logprobs": torch.zeros(2, 2, dtype=F64)}, "reference_logprobs has shape"),
        ({"advantages": torch.zeros(3, dtype=F64)}, "advantages has shape"),
        ({"advantages": torch.tensor([1.0, float("inf")], dtype=F64)}, "advantages contains NaN"),
        ({"mask": MASK.to(F64) * 0.5}, "mask must contain only 0 and 1"),
        ({"mask": MASK.long()}, "mask must be bool or floating-point"),
        ({"total_sequences": 1}, "total_sequences"),
        ({"total_tokens": 4}, "total_tokens"),
        ({"config": LossConfig(name="dr_grpo", dr_grpo_max_tokens=2)}, "dr_grpo_max_tokens=2"),
        ({"config": "grpo"}, "config must be a LossConfig"),
    ],
)
def test_bad_inputs_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _bad_call(**overrides)


def test_token_mean_loss_with_an_empty_mask_needs_a_total():
    empty = torch.zeros_like(MASK)
    with pytest.raises(ValueError, match="mask marks no tokens"):
        _bad_call(mask=empty, config=LossConfig(name="dapo"))
    # inside a larger batch an all-padding micro-batch is fine and contributes nothing
    loss, metrics = policy_loss(
        LOGPROBS, PROXIMAL, PROXIMAL, torch.tensor(ADVANTAGES, dtype=F64), empty,
        LossConfig(name="dapo"), total_tokens=10,
    )
    assert loss.item() == 0.0 and metrics["clip_fraction"] == 0.0
