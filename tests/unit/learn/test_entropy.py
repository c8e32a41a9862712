"""Which tokens Clip-Cov and KL-Cov select (learn/entropy.py), on constructed batches, and the
adaptive entropy bonus's coefficient. The loss's side (the gradient it stops or penalises) is in
test_losses.py."""

from __future__ import annotations

import pytest
import torch

from decentrl.learn.entropy import AdaptiveEntropy, covariance_selection, token_covariance

F64 = torch.float64

# Two sequences of three tokens, the last of sequence 1 padding. Advantages +1 and -1: the mean
# advantage over the 5 counted tokens is (3 - 2) / 5 = 0.2.
PROXIMAL = torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -0.2, -9.0]], dtype=F64)
ADVANTAGES = torch.tensor([1.0, -1.0], dtype=F64)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_the_covariance_is_centred_on_the_counted_tokens_only() -> None:
    covariance = token_covariance(PROXIMAL, ADVANTAGES, MASK)
    mean_logprob = (-0.1 - 2.0 - 0.5 - 3.0 - 0.2) / 5
    expected = torch.tensor([[(-0.1 - mean_logprob) * 0.8, (-2.0 - mean_logprob) * 0.8,
                              (-0.5 - mean_logprob) * 0.8],
                             [(-3.0 - mean_logprob) * -1.2, (-0.2 - mean_logprob) * -1.2, 0.0]],
                            dtype=F64)
    torch.testing.assert_close(covariance, expected)
    # The padding's log-prob (-9) moved nothing: the centred values sum to zero per factor.
    assert float((covariance * MASK).sum()) == pytest.approx(float(covariance.sum()))


def test_kl_cov_selects_the_largest_covariances() -> None:
    # The mean log-prob is -1.16. Row 0 (A - 0.2 = 0.8): 0.848, -0.672, 0.528; row 1 (A - 0.2 =
    # -1.2): 2.208, -1.152. The two largest: row 1's token 0, then row 0's token 0.
    selected = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "kl_cov", fraction=0.4)
    assert selected.tolist() == [[True, False, False], [True, False, False]]
    # At least one token, however small the fraction; never a padding token.
    one = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "kl_cov", fraction=1e-6)
    assert one.tolist() == [[False, False, False], [True, False, False]]
    every = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "kl_cov", fraction=1.0)
    assert every.tolist() == MASK.tolist()


def test_clip_cov_draws_only_within_its_bounds() -> None:
    # Within (0.5, 1.0): 0.848 and 0.528 (row 0, tokens 0 and 2); 2.208 is above the bound.
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        selected = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "clip_cov", fraction=0.2,
                                        bounds=(0.5, 1.0), generator=generator)
        assert int(selected.sum()) == 1  # floor(0.2 * 5) = 1
        assert selected[0, 0] or selected[0, 2]
    # Both drawn over the seeds (a random draw, not always the same token).
    drawn = {tuple(covariance_selection(PROXIMAL, ADVANTAGES, MASK, "clip_cov", 0.2, (0.5, 1.0),
                                        torch.Generator().manual_seed(seed)).flatten().tolist())
             for seed in range(20)}
    assert len(drawn) == 2
    # Fewer candidates than wanted: all of them. None within the bounds: none.
    every = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "clip_cov", 1.0, (0.5, 1.0))
    assert every.tolist() == [[True, False, True], [False, False, False]]
    none = covariance_selection(PROXIMAL, ADVANTAGES, MASK, "clip_cov", 1.0, (5.0, 9.0))
    assert not none.any()


def test_the_same_seed_selects_the_same_tokens() -> None:
    proximal = torch.randn(16, 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    advantages = torch.randn(16, dtype=F64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(16, 12, dtype=torch.bool)

    def draw(seed: int) -> torch.Tensor:
        return covariance_selection(proximal, advantages, mask, "clip_cov", 0.05, (-10.0, 10.0),
                                    torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7)) and not torch.equal(draw(7), draw(8))


def test_nothing_is_selected_without_a_method_or_counted_tokens() -> None:
    assert not covariance_selection(PROXIMAL, ADVANTAGES, MASK, "none", 0.5).any()
    empty = torch.zeros_like(MASK)
    assert not covariance_selection(PROXIMAL, ADVANTAGES, empty, "kl_cov", 0.5).any()


@pytest.mark.parametrize(("method", "fraction", "bounds", "message"), [
    ("top_cov", 0.1, (1.0, 5.0), "method must be one of"),
    ("kl_cov", 0.0, (1.0, 5.0), "fraction must be in"),
    ("kl_cov", 1.5, (1.0, 5.0), "fraction must be in"),
    ("clip_cov", 0.1, (5.0, 1.0), "low < high"),
])
def test_bad_selection_settings_are_refused(method: str, fraction: float,
                                            bounds: tuple[float, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        covariance_selection(PROXIMAL, ADVANTAGES, MASK, method, fraction, bounds)  # type: ignore[arg-type]


def test_the_adaptive_coefficient_rises_below_target_and_falls_above() -> None:
    control = AdaptiveEntropy(target=0.5, step=0.01, max_coef=0.025)
    assert control.applied == 0.0
    control.update(0.3)
    assert control.coef == pytest.approx(0.01) and control.applied == pytest.approx(0.01)
    control.update(0.3)
    control.update(0.3)
    assert control.coef == pytest.approx(0.025)  # capped
    control.update(0.7)  # above target: falls, and is not applied
    assert control.coef == pytest.approx(0.015) and control.applied == 0.0
    for _ in range(3):
        control.update(0.9)
    assert control.coef == 0.0  # never below zero
    with pytest.raises(ValueError, match="entropy must be finite"):
        control.update(float("nan"))
    with pytest.raises(ValueError, match="target must be"):
        AdaptiveEntropy(target=0.0, step=0.01, max_coef=0.1)
