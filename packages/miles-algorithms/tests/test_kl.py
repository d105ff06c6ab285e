"""KL estimators k1, k2, k3, low_var_kl: values by hand, finiteness at log ratios of +-1e4."""

from __future__ import annotations

import math

import pytest
import torch
from miles_algorithms.kl import kl_divergence, masked_kl

# x = log pi - log pi_ref = 0.5, -1.0, 0.0
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])


def test_k1_is_the_log_ratio():
    assert kl_divergence(LOGPROBS, REF, "k1").tolist() == [[0.5, -1.0, 0.0]]


def test_k2_is_half_the_squared_log_ratio():
    # 0.5 * 0.25 = 0.125, 0.5 * 1 = 0.5, 0
    assert kl_divergence(LOGPROBS, REF, "k2").tolist() == [[0.125, 0.5, 0.0]]


def test_k3_by_hand():
    # e^-x - 1 + x:  e^-0.5 = 0.60653066 -> 0.10653066;  e^1 = 2.71828183 -> 0.71828183;  0
    expected = torch.tensor([[0.10653066, 0.71828183, 0.0]])
    assert torch.allclose(kl_divergence(LOGPROBS, REF, "k3"), expected, atol=1e-7)
    assert torch.allclose(kl_divergence(LOGPROBS, REF, "low_var_kl"), expected, atol=1e-7)


def test_low_var_kl_is_bounded_by_ten():
    # x = -20: k3 = e^20 - 21 = 485165174.4; low_var_kl clamps it to 10.  x = 3: e^-3 + 2 = 2.0497871
    x = torch.tensor([[-20.0, 3.0]])
    assert kl_divergence(x, torch.zeros_like(x), "low_var_kl")[0].tolist() == pytest.approx([10.0, 2.0497871])
    assert float(kl_divergence(x, torch.zeros_like(x), "k3")[0, 0]) == pytest.approx(math.exp(20) - 21, rel=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_extreme_log_ratios_stay_finite_with_finite_gradients(estimator):
    logprobs = torch.tensor([[-1e4, 0.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1e4, -3.0]])
    kl = kl_divergence(logprobs, ref, estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logprobs.grad).all()


def test_k3_clamps_the_log_ratio_at_twenty():
    # x = +1e4 -> clamped to 20: e^-20 - 1 + 20 = 19.000000002
    assert kl_divergence(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), "k3").item() == pytest.approx(19.0)


def test_masked_kl_ignores_masked_inputs_even_nan():
    mask = torch.tensor([[True, False, True]])
    logprobs = torch.tensor([[-1.0, float("nan"), -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, float("inf"), -0.5]])
    kl = masked_kl(logprobs, ref, mask, "k3")
    kl.sum().backward()
    assert torch.allclose(kl, torch.tensor([[0.10653066, 0.0, 0.0]]))
    assert logprobs.grad[0, 1] == 0.0 and torch.isfinite(logprobs.grad).all()


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of k1, k2, k3, low_var_kl"):
        kl_divergence(LOGPROBS, REF, "k4")
