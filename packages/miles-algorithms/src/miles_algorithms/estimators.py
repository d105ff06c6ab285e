"""Advantage estimators, registered by name (``algorithm.advantage``).

Each is a callable ``(batch, params) -> AdvantageResult``, registered in an ``AdvantageSpec`` that
declares what it needs (:data:`miles_algorithms.catalog.ADVANTAGE_SPECS`); whitening and
distillation are the kernel's, applied after every estimator (:mod:`miles.advantages`). Notation
for row ``b`` (one piece of a rollout) with trainable tokens ``t``:

- ``R``: the rollout's scalar reward; ``R~``: group-normalised (see :mod:`normalization`);
- ``kl_t = KL estimate(log pi_sample(t) - log pi_ref(t))`` with ``params.kl_estimator``, where
  pi_sample is the policy that produced the rollout (``old_logprobs``, else ``rollout_logprobs``);
  ``beta = params.kl_coef`` (0: no reference model needed);
- token rewards ``r_t = -beta * kl_t``, plus ``R`` (or ``R~``) on the row's last trainable token.

Estimators (the discount runs over trainable tokens only; see :mod:`gae`):

- ``grpo``: ``A_t = R~ - beta * kl_t`` (``R~`` std-scaled unless ``normalize_std: false``, Dr.GRPO);
- ``gspo``: same advantages as grpo, meant for the ``gspo`` policy loss (sequence-level ratio);
- ``ppo``: GAE(gamma, lam) over ``r_t`` with the critic's values; returns = A + V;
- ``reinforce_pp``: ``G_t = sum_k gamma^k r_{t+k}`` with raw ``R``, A = batch-whitened G;
- ``reinforce_pp_baseline``: as reinforce_pp with the group-centred reward ``R - mean_group(R)``.

A rollout split into several rows: each row receives the rollout's reward at its own last
trainable token (each piece is a complete model-generated sequence with its own context).
"""

from __future__ import annotations

import torch
from miles_contracts import AdvantageEstimator, AdvantageResult, AlgorithmParams, TrainBatch

from miles_algorithms.gae import discounted_returns, gae
from miles_algorithms.kl import masked_kl
from miles_algorithms.masking import batch_mean, last_trainable_position, masked, trainable, whiten
from miles_algorithms.normalization import group_normalized_rewards, require_finite_rewards


def reward_kl(batch: TrainBatch, params: AlgorithmParams) -> torch.Tensor:
    """``[B, T]``: ``kl_t`` of the sampling policy against the reference, 0 off-mask or when beta is 0."""
    mask = trainable(batch.loss_mask)
    if params.kl_coef == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if batch.ref_logprobs is None:
        raise ValueError(
            "algorithm.kl_coef > 0 needs reference log-probs (batch.ref_logprobs is None): "
            "set train.use_reference: true, or set algorithm.kl_coef: 0"
        )
    sampling = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    return masked_kl(sampling, batch.ref_logprobs, mask, params.kl_estimator).detach()


def token_rewards(batch: TrainBatch, params: AlgorithmParams, final_reward: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``-beta * kl_t`` on trainable tokens plus ``final_reward[b]`` on each row's last one."""
    require_finite_rewards(final_reward, batch.rollout_ids)
    mask = trainable(batch.loss_mask)
    rewards = -params.kl_coef * reward_kl(batch, params)
    last, has_any = last_trainable_position(mask)
    final = torch.where(has_any, final_reward.float(), torch.zeros_like(final_reward, dtype=torch.float32))
    return rewards.scatter_add(-1, last[:, None], final[:, None])


def _metrics(batch: TrainBatch, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {
        "advantage_mean": float(batch_mean(advantages, mask)),
        "advantage_abs_max": float(masked(advantages.abs(), mask).max()) if mask.any() else 0.0,
    }


class GRPO:
    """Group-relative advantage, one value per sequence (minus the per-token KL penalty)."""

    def __call__(self, batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult:
        mask = trainable(batch.loss_mask)
        normalized = group_normalized_rewards(
            batch.rewards, batch.group_ids, batch.rollout_ids, scale_by_std=params.normalize_std
        )
        advantages = masked(normalized[:, None] - params.kl_coef * reward_kl(batch, params), mask)
        return AdvantageResult(advantages, None, _metrics(batch, advantages, mask))


class GSPO(GRPO):
    """GRPO's advantages for GSPO's sequence-level importance ratio (``train.policy_loss: gspo``);
    the pairing is declared by its spec (``ADVANTAGE_SPECS["gspo"].policy_loss`` in :mod:`.catalog`)."""


class PPO:
    """Critic-based GAE; masked (tool / user) tokens are not decision steps."""

    def __call__(self, batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult:
        if batch.values is None:
            raise ValueError("the ppo estimator needs critic values (batch.values is None): set train.use_critic: true")
        mask = trainable(batch.loss_mask)
        rewards = token_rewards(batch, params, batch.rewards)
        advantages, returns = gae(rewards, batch.values, mask, params.gamma, params.lam)
        metrics = _metrics(batch, advantages, mask) | {"return_mean": float(batch_mean(returns, mask))}
        return AdvantageResult(advantages, returns, metrics)


class ReinforcePP:
    """REINFORCE++: discounted returns with a KL token penalty, whitened over the batch."""

    def final_reward(self, batch: TrainBatch) -> torch.Tensor:
        return batch.rewards.float()

    def __call__(self, batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult:
        mask = trainable(batch.loss_mask)
        returns = discounted_returns(token_rewards(batch, params, self.final_reward(batch)), mask, params.gamma)
        advantages = whiten(returns, mask)
        metrics = _metrics(batch, advantages, mask) | {"return_mean": float(batch_mean(returns, mask))}
        return AdvantageResult(advantages, returns, metrics)


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++ with the prompt group's mean reward as baseline (centred, not std-scaled)."""

    def final_reward(self, batch: TrainBatch) -> torch.Tensor:
        return group_normalized_rewards(batch.rewards, batch.group_ids, batch.rollout_ids, scale_by_std=False)


ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": GRPO(),
    "gspo": GSPO(),
    "ppo": PPO(),
    "reinforce_pp": ReinforcePP(),
    "reinforce_pp_baseline": ReinforcePPBaseline(),
}
