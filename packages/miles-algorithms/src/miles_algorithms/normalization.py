"""Reward normalisation within prompt groups, counting each rollout once.

A prompt group holds the ``n`` rollouts sampled for one prompt. A rollout may be split into several
rows (context compaction, sub-agents): its rows share a ``rollout_id`` and must carry the same
reward, and the rollout enters its group's statistics once, however many rows it has.

For a group with rollout rewards ``R_1 .. R_n`` (mean ``m``, unbiased std ``s``):

- centred (Dr.GRPO, REINFORCE++-baseline): ``R_i - m``;
- scaled (GRPO): ``(R_i - m) / (s + eps)`` when ``n > 1``; a single-rollout group stays centred
  (its value is 0 anyway), and a group of equal rewards gives 0 (``0 / eps``).
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_normalized_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    rollout_ids: torch.Tensor,
    *,
    scale_by_std: bool,
    eps: float = EPS,
) -> torch.Tensor:
    """``[B]`` float32: each row's rollout reward, centred (and optionally std-scaled) in its group.

    :param rewards: ``[B]`` reward of each row's rollout (rows of one rollout must agree).
    :param group_ids: ``[B]`` prompt group of each row.
    :param rollout_ids: ``[B]`` rollout of each row.
    :param scale_by_std: divide by the group's unbiased std (GRPO); False centres only (Dr.GRPO).
    :raises ValueError: when rows of one rollout disagree on reward or group, or a reward is not finite.
    """
    require_finite_rewards(rewards, rollout_ids)
    if rewards.numel() == 0:
        return rewards.float()
    rollout, row_to_rollout = torch.unique(rollout_ids, return_inverse=True)
    per_rollout_reward = _one_value_per_rollout(rewards.double(), row_to_rollout, rollout, "reward")
    per_rollout_group = _one_value_per_rollout(group_ids.double(), row_to_rollout, rollout, "group id")

    group, rollout_to_group = torch.unique(per_rollout_group, return_inverse=True)
    size = torch.zeros(len(group), dtype=torch.float64, device=rewards.device).index_add_(
        0, rollout_to_group, torch.ones_like(per_rollout_reward)
    )
    total = torch.zeros_like(size).index_add_(0, rollout_to_group, per_rollout_reward)
    mean = total / size
    centred = per_rollout_reward - mean[rollout_to_group]
    if scale_by_std:
        square = torch.zeros_like(size).index_add_(0, rollout_to_group, centred.square())
        std = (square / (size - 1).clamp(min=1)).sqrt()
        scale = torch.where(size > 1, std + eps, torch.ones_like(std))
        centred = centred / scale[rollout_to_group]
    return centred[row_to_rollout].to(torch.float32)


def require_finite_rewards(rewards: torch.Tensor, rollout_ids: torch.Tensor) -> None:
    """Raise, naming the rollouts, when a reward is nan or inf (a failed score must not train)."""
    bad = ~torch.isfinite(rewards)
    if bad.any():
        ids = rollout_ids[bad].tolist()
        raise ValueError(f"rewards must be finite; rollouts {ids[:8]} have nan/inf rewards (drop or re-score them first)")


def _one_value_per_rollout(
    values: torch.Tensor, row_to_rollout: torch.Tensor, rollout: torch.Tensor, what: str
) -> torch.Tensor:
    """``[R]``: the value each rollout's rows share; raises if its rows disagree."""
    low = torch.full(rollout.shape, float("inf"), dtype=values.dtype, device=values.device)
    high = torch.full_like(low, float("-inf"))
    low = low.scatter_reduce(0, row_to_rollout, values, reduce="amin")
    high = high.scatter_reduce(0, row_to_rollout, values, reduce="amax")
    disagree = low != high
    if disagree.any():
        ids = rollout[disagree].tolist()
        raise ValueError(
            f"rows of one rollout must share one {what}; rollouts {ids[:8]} have rows with different {what}s "
            f"(set the same {what} on every row of a split rollout)"
        )
    return low
