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


def _episode(index: int, rewards: dict[str, float], branches: list[str]) -> list:
    """The training rows (``Sample.rows``) of an episode of prompt group 0 whose branches have the
    roles ``branches`` (the first is the primary), scored ``rewards`` per role."""
    from miles_contracts import Branch, Sample, Status

    def branch(branch_id: int, role: str) -> Sample:
        return Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], status=Status.COMPLETED,
                      branch=Branch(episode_id=f"e{index}", branch_id=branch_id, role=role,
                                    cause="root" if branch_id == 0 else "compaction"))

    primary, *others = (branch(i, role) for i, role in enumerate(branches))
    primary.index, primary.branches = index, others
    primary.reward, primary.role_rewards = rewards[branches[0]], dict(rewards)
    return primary.rows()


def _advantages(rows: list) -> list[float]:
    from miles_contracts import TrainBatch

    batch = TrainBatch.from_samples(rows, pad_token_id=0)
    return group_normalized_rewards(batch.rewards, batch.group_ids, batch.rollout_ids, scale_by_std=True).tolist()


def test_an_episode_of_three_branches_counts_once_in_its_group():
    """Rewards 1, 0, 0: the episode of three rows gets the advantage it gets as one row."""
    three = _advantages([*_episode(0, {"agent": 1.0}, ["agent"] * 3), *_episode(1, {"agent": 0.0}, ["agent"]),
                         *_episode(2, {"agent": 0.0}, ["agent"])])
    one = _advantages([*_episode(0, {"agent": 1.0}, ["agent"]), *_episode(1, {"agent": 0.0}, ["agent"]),
                       *_episode(2, {"agent": 0.0}, ["agent"])])
    assert three[:3] == [one[0]] * 3 and three[3:] == one[1:]
    assert one[0] == pytest.approx(2 / 3 / (math.sqrt(1 / 3) + 1e-6))


def test_each_role_of_an_episode_is_normalised_among_its_own_role():
    """A zero-sum game of two roles: each role's advantage comes from its own group (solver rewards
    1, 0; critic 0, 1), never from the other role's rewards."""
    rows = [*_episode(0, {"solver": 1.0, "critic": 0.0}, ["solver", "critic", "solver"]),
            *_episode(1, {"solver": 0.0, "critic": 1.0}, ["solver", "critic"])]
    advantages = _advantages(rows)
    high = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert advantages == pytest.approx([high, -high, high, -high, high])
