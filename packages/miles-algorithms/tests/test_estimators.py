"""Advantage estimators by hand, and the conformance suite on every registered estimator."""

from __future__ import annotations

import math

import pytest
import torch
from miles.advantages import estimate_advantages
from miles.kernel import Kernel
from miles_algorithms.catalog import ADVANTAGE_SPECS
from miles_algorithms.estimators import GRPO, GSPO, PPO, ReinforcePP, ReinforcePPBaseline
from miles_contracts import AlgorithmParams
from miles_contracts.testing.advantage import check_advantage

REGISTERED = Kernel.load().advantages()


@pytest.mark.parametrize("name", ["grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline"])
def test_registered_estimator_passes_the_conformance_suite(name):
    assert REGISTERED.get(name) is ADVANTAGE_SPECS[name]  # the spec as registered, capabilities included
    check_advantage(REGISTERED.get(name), stage=estimate_advantages)


def test_estimators_are_registered_by_this_package():
    assert REGISTERED.entry("grpo").distribution == "miles-algorithms"


def test_grpo_by_hand_with_kl_penalty(make_batch):
    # group rewards 1, 0 (two rollouts): mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> +-0.7071058
    # (eps 1e-6 in the denominator). KL penalty k1, beta 0.1: kl_t = old - ref
    #   row 0: kl 0.2, 0.0 -> A = 0.7071058 - 0.02, 0.7071058
    #   row 1: kl -0.4 on its one trainable token -> A = -0.7071058 + 0.04
    batch = make_batch(
        [[0, 1, 1], [0, 0, 1]],
        rewards=[1.0, 0.0],
        old_logprobs=[[5.0, -1.0, -1.0], [5.0, 5.0, -1.0]],
        ref_logprobs=[[0.0, -1.2, -1.0], [0.0, 0.0, -0.6]],
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    result = GRPO()(batch, AlgorithmParams(kl_coef=0.1, kl_estimator="k1"))
    assert torch.allclose(result.advantages, torch.tensor([[0.0, a - 0.02, a], [0.0, 0.0, -a + 0.04]]), atol=1e-6)
    assert result.returns is None


def test_dr_grpo_centres_only(make_batch):
    batch = make_batch([[1, 1], [1, 0], [0, 1]], rewards=[3.0, 1.0, 2.0])
    result = GRPO()(batch, AlgorithmParams(normalize_std=False))
    # mean 2: 1, -1, 0 on trainable tokens
    assert result.advantages.tolist() == [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]]


def test_kl_penalty_uses_rollout_logprobs_without_an_old_pass(make_batch):
    batch = make_batch([[1]], rewards=[0.0], rollout_logprobs=[[-1.0]], ref_logprobs=[[-1.5]])
    # kl = -1.0 - (-1.5) = 0.5 (k1); A = 0 - 0.2 * 0.5
    result = GRPO()(batch, AlgorithmParams(kl_coef=0.2, kl_estimator="k1"))
    assert result.advantages.tolist() == [[pytest.approx(-0.1)]]


def test_kl_penalty_without_reference_is_an_error(make_batch):
    with pytest.raises(ValueError, match="kl_coef > 0 needs reference log-probs"):
        GRPO()(make_batch([[1]], rewards=[1.0]), AlgorithmParams(kl_coef=0.1))


def test_gspo_has_grpo_advantages_and_asks_for_the_gspo_loss(make_batch):
    batch = make_batch([[1, 1], [1, 0]], rewards=[1.0, 0.0])
    assert torch.equal(GSPO()(batch, AlgorithmParams()).advantages, GRPO()(batch, AlgorithmParams()).advantages)
    assert REGISTERED.get("gspo").policy_loss == "gspo" and REGISTERED.get("grpo").policy_loss is None


def test_ppo_gae_by_hand(make_batch):
    # gamma = lam = 1: A_t = R - V_t on trainable tokens (1, 2, 4); returns = R = 1
    batch = make_batch([[0, 1, 1, 0, 1]], rewards=[1.0], values=[[9.0, 0.2, 0.5, 9.0, 0.7]])
    result = PPO()(batch, AlgorithmParams(gamma=1.0, lam=1.0))
    assert torch.allclose(result.advantages, torch.tensor([[0.0, 0.8, 0.5, 0.0, 0.3]]))
    assert torch.allclose(result.returns, torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]]))


def test_ppo_without_values_is_an_error(make_batch):
    with pytest.raises(ValueError, match="needs critic values"):
        PPO()(make_batch([[1]], rewards=[1.0]), AlgorithmParams())


def test_reinforce_pp_returns_with_kl_penalty_by_hand(make_batch):
    # one row, R = 1, gamma 0.5, beta 0.1, k1: kl = old - ref = 0.2, 0.0, -0.4
    #   token rewards: -0.02, 0, +0.04 + 1 = 1.04
    #   G2 = 1.04, G1 = 0 + 0.5 * 1.04 = 0.52, G0 = -0.02 + 0.5 * 0.52 = 0.24
    batch = make_batch(
        [[1, 1, 1]], rewards=[1.0], old_logprobs=[[-1.0, -1.0, -1.0]], ref_logprobs=[[-1.2, -1.0, -0.6]]
    )
    result = ReinforcePP()(batch, AlgorithmParams(gamma=0.5, kl_coef=0.1, kl_estimator="k1"))
    assert torch.allclose(result.returns, torch.tensor([[0.24, 0.52, 1.04]]), atol=1e-6)


def test_reinforce_pp_whitens_over_the_batch(make_batch):
    # returns: 1, 1 (row 0) and 0, 0, 0 (row 1); token mean 2/5 = 0.4
    # variance (2 * 0.6^2 + 3 * 0.4^2) / 5 = 0.24, std 0.4898979
    #   A = 0.6 / 0.4898979 = 1.2247449 and -0.4 / 0.4898979 = -0.8164966
    batch = make_batch([[1, 1, 0], [1, 1, 1]], rewards=[1.0, 0.0])
    result = ReinforcePP()(batch, AlgorithmParams())
    hi, lo = 1.2247449, -0.8164966
    assert torch.allclose(result.advantages, torch.tensor([[hi, hi, 0.0], [lo, lo, lo]]), atol=1e-6)


def test_reinforce_pp_baseline_subtracts_the_group_mean(make_batch):
    # group 0 rewards 1, 0, 0.5 -> mean 0.5 -> 0.5, -0.5, 0 (not std-scaled); group 1: single -> 0
    batch = make_batch(
        [[1, 1], [1, 1], [1, 1], [1, 1]], rewards=[1.0, 0.0, 0.5, 7.0], group_ids=[0, 0, 0, 1]
    )
    result = ReinforcePPBaseline()(batch, AlgorithmParams(gamma=1.0))
    assert torch.allclose(result.returns, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))


def test_split_rollout_gets_its_reward_on_each_piece(make_batch):
    # rollout 1 split over rows 1 and 2: each piece ends with the rollout's reward
    batch = make_batch([[1, 1], [1, 1], [1, 1]], rewards=[0.0, 2.0, 2.0], rollout_ids=[0, 1, 1])
    result = ReinforcePP()(batch, AlgorithmParams(gamma=1.0))
    assert result.returns.tolist() == [[0.0, 0.0], [2.0, 2.0], [2.0, 2.0]]
