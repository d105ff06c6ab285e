"""Generalised advantage estimation and discounted returns over trainable tokens only.

Each row's trainable tokens form the decision process (see :mod:`miles_algorithms.scan`):
for trainable steps ``j = 0 .. n-1`` of a row, in order,

    delta_j = r_j + gamma * V_{j+1} - V_j        (V_n = 0: nothing follows the last action)
    A_j     = delta_j + gamma * lam * A_{j+1}    (A_n = 0)
    G_j     = A_j + V_j                          (the critic's target)

A truncated response is treated like a terminated one (bootstrap value 0), because the reward
model scored exactly what was generated.
"""

from __future__ import annotations

import torch

from miles_algorithms.scan import Compressed, reverse_discounted_sum


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, both ``[B, T]`` and 0 off-mask.

    :param token_rewards: ``[B, T]`` reward of each trainable token (off-mask entries ignored).
    :param values: ``[B, T]`` critic value of the state before each token (off-mask ignored).
    :param mask: ``[B, T]`` bool, trainable tokens.
    """
    plan = Compressed.of(mask)
    r = plan.compress(token_rewards.float())  # [B, L]
    v = plan.compress(values.float())  # [B, L], 0 in empty slots, so V after the last step is 0
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = torch.where(plan.valid, r + gamma * v_next - v, torch.zeros_like(r))
    advantages = reverse_discounted_sum(delta, gamma * lam)
    width = mask.shape[-1]
    return plan.expand(advantages, width), plan.expand(advantages + v, width)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[B, T]``: ``G_j = r_j + gamma * G_{j+1}`` over each row's trainable tokens, 0 off-mask."""
    plan = Compressed.of(mask)
    return plan.expand(reverse_discounted_sum(plan.compress(token_rewards.float()), gamma), mask.shape[-1])
