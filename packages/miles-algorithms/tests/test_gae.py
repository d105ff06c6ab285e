"""Discounted returns and GAE over trainable tokens: masked tokens are not decision steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_algorithms.gae import discounted_returns, gae
from miles_algorithms.scan import CHUNK, reverse_discounted_sum

GARBAGE = 100.0  # put at masked positions: it must never show up in a result


def test_discounted_returns_skip_masked_tokens():
    # trainable positions 1, 2, 5 with rewards 1, 2, 3; gamma 0.5. Compressed sequence:
    #   G2 = 3, G1 = 2 + 0.5 * 3 = 3.5, G0 = 1 + 0.5 * 3.5 = 2.75
    # (across the masked gap at 3-4 the discount applies once, not three times)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    rewards = torch.tensor([[GARBAGE, 1.0, 2.0, GARBAGE, GARBAGE, 3.0]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    assert out.tolist() == [[0.0, 2.75, 3.5, 0.0, 0.0, 3.0]]


def test_gae_matches_the_compressed_sequence_by_hand():
    # trainable positions 1, 2, 5, 6; reward 1 on the last; values 0.5, 0.4, 0.6, 0.8; gamma 0.9, lam 0.5
    #   delta3 = 1 + 0.9*0   - 0.8 =  0.2
    #   delta2 = 0 + 0.9*0.8 - 0.6 =  0.12
    #   delta1 = 0 + 0.9*0.6 - 0.4 =  0.14
    #   delta0 = 0 + 0.9*0.4 - 0.5 = -0.14
    # gamma*lam = 0.45:
    #   A3 = 0.2, A2 = 0.12 + 0.45*0.2 = 0.21, A1 = 0.14 + 0.45*0.21 = 0.2345,
    #   A0 = -0.14 + 0.45*0.2345 = -0.034475
    # returns = A + V = 0.465525, 0.6345, 0.81, 1.0
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([[GARBAGE, 0.0, 0.0, GARBAGE, GARBAGE, 0.0, 1.0]])
    values = torch.tensor([[GARBAGE, 0.5, 0.4, GARBAGE, GARBAGE, 0.6, 0.8]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    expected_a = torch.tensor([[0.0, -0.034475, 0.2345, 0.0, 0.0, 0.21, 0.2]])
    expected_r = torch.tensor([[0.0, 0.465525, 0.6345, 0.0, 0.0, 0.81, 1.0]])
    assert torch.allclose(advantages, expected_a, atol=1e-6)
    assert torch.allclose(returns, expected_r, atol=1e-6)


def test_gae_with_unit_gamma_lambda_is_reward_minus_value():
    # gamma = lam = 1: A_j = sum of deltas telescopes to R - V_j
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.2, 0.5, 9.0, 0.7]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.0, 0.8, 0.5, 0.0, 0.3]]))
    assert torch.allclose(returns, torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]]))


def test_fully_masked_row_gives_zeros():
    mask = torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.bool)
    advantages, returns = gae(torch.full((2, 3), 5.0), torch.full((2, 3), 3.0), mask, 0.9, 0.9)
    assert advantages[0].tolist() == [0.0, 0.0, 0.0] and returns[0].tolist() == [0.0, 0.0, 0.0]


def _loop_gae(rewards, values, mask, gamma, lam):
    """Reference: walk each row's trainable positions from the end, one step at a time (float64)."""
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            advantages[b, t] = running
            next_value = float(values[b, t])
    return advantages


@settings(max_examples=30, deadline=None)
@given(
    width=st.integers(1, 2 * CHUNK + 40),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_gae_matches_a_step_by_step_loop(width, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, width, generator=g) < 0.7
    rewards = torch.randn(3, width, generator=g)
    values = torch.randn(3, width, generator=g)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected = _loop_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(advantages.double(), expected, atol=1e-3, rtol=1e-4)
    assert torch.allclose(returns.double(), torch.where(mask, expected + values.double(), 0.0), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.99, 1.0])
def test_chunked_scan_is_stable_on_long_rows(discount):
    # 5000 steps: a closed form with discount**-k would overflow float32 past ~9000 steps at 0.99
    x = torch.ones(1, 5000, dtype=torch.float64)
    y = reverse_discounted_sum(x, discount)
    steps_left = torch.arange(5000, 0, -1, dtype=torch.float64)  # terms in each suffix
    expected = steps_left if discount == 1.0 else (1 - discount**steps_left) / (1 - discount)
    assert torch.allclose(y[0], expected, rtol=1e-9)


def test_discount_outside_unit_interval_is_rejected():
    with pytest.raises(ValueError, match=r"discount must lie in \[0, 1\]"):
        reverse_discounted_sum(torch.ones(1, 3), 1.5)
