"""Group reward normalisation: GRPO (std-scaled) and Dr.GRPO (centred), siblings counted once."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_algorithms.normalization import group_normalized_rewards


def normalize(rewards, groups, rollouts, scale):
    return group_normalized_rewards(
        torch.tensor(rewards), torch.tensor(groups), torch.tensor(rollouts), scale_by_std=scale
    )


def test_grpo_scales_by_unbiased_group_std():
    # rewards 1, 2, 3, 6: mean 3, centred -2, -1, 0, 3
    # unbiased variance (4 + 1 + 0 + 9) / 3 = 14/3, std = 2.160246899
    out = normalize([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0], [0, 1, 2, 3], scale=True)
    std = 2.160246899 + 1e-6
    assert torch.allclose(out, torch.tensor([-2 / std, -1 / std, 0.0, 3 / std]), atol=1e-6)


def test_dr_grpo_only_centres():
    out = normalize([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0], [0, 1, 2, 3], scale=False)
    assert out.tolist() == [-2.0, -1.0, 0.0, 3.0]


def test_split_rollout_counts_once():
    # rows 1 and 2 are one rollout (reward 7): distinct rewards 1, 7, 4 -> mean 4 (not 19/4)
    # centred -3, 3, 3, 0; unbiased std sqrt((9 + 9 + 0) / 2) = 3 -> -1, 1, 1, 0
    out = normalize([1.0, 7.0, 7.0, 4.0], [0, 0, 0, 0], [10, 11, 11, 12], scale=True)
    assert torch.allclose(out, torch.tensor([-1.0, 1.0, 1.0, 0.0]), atol=1e-6)


def test_groups_are_independent_and_may_interleave():
    # group 0: 1, 3 -> mean 2, centred -1, 1, std sqrt(2) -> -0.70711, 0.70711
    # group 1: 10, 30 -> mean 20, centred -10, 10, std sqrt(200) -> same
    out = normalize([1.0, 10.0, 3.0, 30.0], [0, 1, 0, 1], [0, 1, 2, 3], scale=True)
    h = 1 / math.sqrt(2)
    assert torch.allclose(out, torch.tensor([-h, -h, h, h]), atol=1e-5)


def test_single_rollout_and_constant_groups_give_zero():
    out = normalize([5.0, 2.0, 2.0, 2.0], [0, 1, 1, 1], [0, 1, 2, 3], scale=True)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_siblings_with_different_rewards_are_rejected():
    with pytest.raises(ValueError, match=r"rollouts \[7\] have rows with different rewards"):
        normalize([1.0, 2.0, 3.0], [0, 0, 0], [6, 7, 7], scale=True)


def test_siblings_in_different_groups_are_rejected():
    with pytest.raises(ValueError, match="different group ids"):
        normalize([1.0, 1.0], [0, 1], [3, 3], scale=True)


def test_non_finite_reward_is_rejected():
    with pytest.raises(ValueError, match=r"rollouts \[1\] have nan/inf rewards"):
        normalize([1.0, float("nan")], [0, 0], [0, 1], scale=True)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=2, max_size=12), st.booleans())
def test_each_group_sums_to_zero(rewards, scale):
    groups = [i % 3 for i in range(len(rewards))]
    out = normalize(rewards, groups, list(range(len(rewards))), scale).double()
    # float32 output: each entry carries a relative rounding error of at most 2**-24
    magnitude = float(out.abs().max()) + (0.0 if scale else max(abs(r) for r in rewards))
    for g in range(3):
        members = out[torch.tensor(groups) == g]
        assert abs(float(members.sum())) <= len(members) * 2**-23 * (1 + magnitude)
