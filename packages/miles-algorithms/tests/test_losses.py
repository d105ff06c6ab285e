"""Policy losses (ppo_clip with separate epsilons and dual clip, gspo, cispo) and the clipped value loss."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from miles_algorithms.losses import cispo, gspo, ppo_clip, value_loss
from miles_contracts import AlgorithmParams

# Five trainable tokens and one masked one (garbage that must not matter):
#   token  ratio  A    unclipped -rho*A   clipped -clip(rho, 0.8, 1.3)*A   max     clip active
#   0      1.5    +1   -1.5               -1.3                              -1.3    yes
#   1      0.5    +1   -0.5               -0.8                              -0.5    no
#   2      0.5    -2   +1.0               +1.6                              +1.6    yes
#   3      1.1    -1   +1.1               +1.1                              +1.1    no
#   4      5.0    -1   +5.0               +1.3                              +5.0    no  (dual clip c=3 -> 3.0)
RATIOS = [1.5, 0.5, 0.5, 1.1, 5.0]
ADVANTAGES = [[1.0, 1.0, -2.0, -1.0, -1.0, 1e4]]
MASK = [[1, 1, 1, 1, 1, 0]]


def ppo_inputs(make_batch):
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -3.0, -1e4]])
    logprobs = (old + torch.log(torch.tensor([*RATIOS, 1.0]))).clone()
    logprobs[0, 5] = float("nan")  # masked: even nan is not read
    logprobs.requires_grad_(True)
    batch = make_batch(MASK, old_logprobs=old.tolist(), advantages=ADVANTAGES)
    return logprobs, batch


def test_ppo_clip_by_hand_with_asymmetric_epsilons(make_batch):
    logprobs, batch = ppo_inputs(make_batch)
    params = AlgorithmParams(eps_clip=0.2, eps_clip_high=0.3)
    loss, metrics = ppo_clip(logprobs, batch, params)
    assert torch.allclose(loss, torch.tensor([[-1.3, -0.5, 1.6, 1.1, 5.0, 0.0]]), atol=1e-5)
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    assert "pg_dual_clipfrac" not in metrics
    loss.sum().backward()
    # d(-rho*A)/dlogp = -rho*A where unclipped binds; 0 where the clip binds or off-mask
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.5, 0.0, 1.1, 5.0, 0.0]]), atol=1e-5)


def test_dual_clip_bounds_negative_advantage_losses(make_batch):
    logprobs, batch = ppo_inputs(make_batch)
    params = AlgorithmParams(eps_clip=0.2, eps_clip_high=0.3, dual_clip_c=3.0)
    loss, metrics = ppo_clip(logprobs, batch, params)
    # token 4: min(5.0, -3 * -1) = 3.0; token 2: min(1.6, 6.0) = 1.6 unchanged
    assert torch.allclose(loss, torch.tensor([[-1.3, -0.5, 1.6, 1.1, 3.0, 0.0]]), atol=1e-5)
    assert metrics["pg_dual_clipfrac"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    loss.sum().backward()
    assert logprobs.grad[0, 4] == 0.0  # bounded: no gradient from the exploded ratio


def test_dual_clip_bound_holds_for_any_ratio(make_batch):
    # for A < 0 the loss never exceeds -c * A, whatever the ratio
    old = torch.zeros(1, 7)
    logprobs = torch.tensor([[-30.0, -5.0, -0.1, 0.0, 0.3, 5.0, 1e4]])
    batch = make_batch([[1] * 7], old_logprobs=old.tolist(), advantages=[[-0.7] * 7])
    loss, _ = ppo_clip(logprobs, batch, AlgorithmParams(dual_clip_c=2.5))
    assert (loss <= 2.5 * 0.7 + 1e-6).all()


def test_extreme_log_ratios_stay_finite(make_batch):
    old = torch.tensor([[0.0, -1e4, 0.0, -1e4]])
    logprobs = torch.tensor([[-1e4, 0.0, -1e4, 0.0]], requires_grad=True)
    batch = make_batch([[1, 1, 1, 1]], old_logprobs=old.tolist(), advantages=[[1.0, 1.0, -1.0, -1.0]])
    for loss_fn in (ppo_clip, gspo, cispo):
        loss, _ = loss_fn(logprobs, batch, AlgorithmParams())
        (grad,) = torch.autograd.grad(loss.sum(), logprobs)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_cispo_by_hand_truncates_the_weight_and_keeps_every_tokens_gradient(make_batch):
    # the same tokens as PPO's table, weights w = clip(rho, 1 - 0.6, 1 + 0.3) = clip(rho, 0.4, 1.3):
    #   token  ratio  A    w     loss -w*A   gradient -w*A (never 0)   truncated
    #   0      1.5    +1   1.3   -1.3        -1.3                      yes
    #   1      0.5    +1   0.5   -0.5        -0.5                      no
    #   2      0.5    -2   0.5   +1.0        +1.0                      no   (PPO: clipped, gradient 0)
    #   3      1.1    -1   1.1   +1.1        +1.1                      no
    #   4      5.0    -1   1.3   +1.3        +1.3                      yes
    logprobs, batch = ppo_inputs(make_batch)
    loss, metrics = cispo(logprobs, batch, AlgorithmParams(cispo_eps_low=0.6, cispo_eps_high=0.3))
    expected = torch.tensor([[-1.3, -0.5, 1.0, 1.1, 1.3, 0.0]])
    assert torch.allclose(loss, expected, atol=1e-5)
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    assert torch.allclose(metrics["ratio"], torch.tensor([[*RATIOS, 0.0]]), atol=1e-5)
    loss.sum().backward()
    assert torch.allclose(logprobs.grad, expected, atol=1e-5)


def test_cispo_has_no_floor_by_default_and_equals_ppo_on_policy(make_batch):
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    batch = make_batch([[1, 1, 1]], old_logprobs=old.tolist(), advantages=[[0.5, -1.0, 2.0]])
    tiny = (old + torch.log(torch.tensor([1e-3, 1e-3, 1e-3]))).requires_grad_(True)
    loss, metrics = cispo(tiny, batch, AlgorithmParams())
    assert torch.allclose(loss, torch.tensor([[-0.5e-3, 1e-3, -2e-3]]), atol=1e-7)  # w = rho: not floored
    assert metrics["pg_clipfrac"].sum() == 0.0
    on_policy = old.clone().requires_grad_(True)
    twin = old.clone().requires_grad_(True)
    cispo_loss, _ = cispo(on_policy, batch, AlgorithmParams())
    ppo_loss, _ = ppo_clip(twin, batch, AlgorithmParams())
    assert torch.equal(cispo_loss, ppo_loss)
    cispo_loss.sum().backward()
    ppo_loss.sum().backward()
    assert torch.equal(on_policy.grad, twin.grad)


def test_gspo_clips_the_geometric_mean_ratio_per_row(make_batch):
    # row 0: log ratios 0.3, -0.1, (masked), 0.4 -> mean 0.6/3 = 0.2 -> s = e^0.2 = 1.2214028
    #        A = 1: max(-1.2214, -clip(1.2214, 0.8, 1.2) = -1.2) = -1.2 on each token, clipped
    # row 1: log ratios 0.1, -0.1, 0.0 -> s = 1: loss -s*A = 0.5 with A = -0.5, not clipped
    old = torch.zeros(2, 4)
    logprobs = torch.tensor([[0.3, -0.1, 7.0, 0.4], [0.1, -0.1, 0.0, 0.0]], requires_grad=True)
    batch = make_batch(
        [[1, 1, 0, 1], [1, 1, 1, 0]], old_logprobs=old.tolist(), advantages=[[1.0, 1.0, 0.0, 1.0], [-0.5, -0.5, -0.5, 0.0]]
    )
    loss, metrics = gspo(logprobs, batch, AlgorithmParams(eps_clip=0.2))
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.2, 0.0, -1.2], [0.5, 0.5, 0.5, 0.0]]), atol=1e-6)
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert torch.allclose(metrics["ratio"][0, 0], torch.tensor(math.exp(0.2)))
    loss.sum().backward()
    # GSPO-token gradient: -A * s * grad log pi_t = 0.5 per token of row 1; row 0 is clipped
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.0]]))


def test_gspo_equals_ppo_clip_on_policy(make_batch):
    # with ratio 1 everywhere both losses are -A and have the same gradient
    old = torch.randn(2, 5)
    logprobs = old.clone().requires_grad_(True)
    advantages = torch.randn(2, 5)
    batch = make_batch([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], old_logprobs=old.tolist(), advantages=advantages.tolist())
    ppo, _ = ppo_clip(logprobs, batch, AlgorithmParams())
    seq, _ = gspo(logprobs, batch, AlgorithmParams())
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logprobs)
    (g_seq,) = torch.autograd.grad(seq.sum(), logprobs)
    assert torch.allclose(ppo, seq) and torch.allclose(g_ppo, g_seq)


def test_losses_need_old_logprobs_and_advantages(make_batch):
    batch = make_batch([[1, 1]])
    with pytest.raises(ValueError, match="needs batch.old_logprobs and batch.advantages"):
        ppo_clip(torch.zeros(1, 2), batch, AlgorithmParams())
    with pytest.raises(ValueError, match="needs batch.old_logprobs and batch.advantages"):
        gspo(torch.zeros(1, 2), replace(batch, old_logprobs=torch.zeros(1, 2)), AlgorithmParams())


def test_value_loss_clipped_by_hand():
    # V_old = 1, G = 2, clip 0.2:
    #   V = 1.5: unclipped (1.5-2)^2 = 0.25, clipped V 1.2 -> (1.2-2)^2 = 0.64 -> 0.64 (clip active)
    #   V = 1.1: both 0.81 -> 0.81
    #   V = 0.5: unclipped 2.25, clipped V 0.8 -> 1.44 -> 2.25
    values = torch.tensor([[1.5, 1.1, 0.5, 1e4]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = value_loss(values, torch.ones(1, 4), torch.full((1, 4), 2.0), mask, clip=0.2)
    assert torch.allclose(loss, torch.tensor([[0.64, 0.81, 2.25, 0.0]]))
    assert metrics["value_clipfrac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
