"""Policy losses (registered by name, ``train.policy_loss``) and the clipped value loss.

A policy loss is ``(logprobs, batch, params) -> (loss [B, T], token_metrics)``: a per-token loss
(0 off-mask) and per-token indicators (``[B, T]``, e.g. 1.0 where the clip was active) that
:func:`miles_algorithms.objective.actor_loss` averages over trainable tokens. ``batch.old_logprobs``
is always set when a loss is called (the objective substitutes the detached current log-probs
when the backend skipped the old-policy pass, making every ratio exactly 1).

Clipped surrogate, for ratio ``rho``, advantage ``A``, ``eps_low = eps_clip``,
``eps_high = eps_clip_high or eps_clip``:

    L = max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)

and with dual clip ``c > 1``, for ``A < 0``: ``L = min(L, -c * A)``, which bounds the loss (and
zeroes the gradient) of a token whose ratio exploded while its advantage is negative.

- ``ppo_clip``: token ratio ``rho_t = exp(log pi_t - log pi_old_t)``.
- ``gspo``: sequence ratio ``s = exp(mean_t(log pi_t - log pi_old_t))`` over the row's trainable
  tokens (the geometric mean of token ratios), applied to every token in the GSPO-token form
  ``s_t = sg(s) * pi_t / sg(pi_t)``: its value is ``s``, its gradient ``s * grad log pi_t``, so
  per-token advantages (KL penalty, distillation) stay per-token. The whole row is clipped
  together. With ``loss_reduction: sequence_mean`` this is exactly the GSPO objective.
- ``cispo`` (MiniMax-M1): no token is clipped out of the gradient; the importance weight itself is
  truncated and detached, ``w_t = sg(clip(rho_t, 1 - cispo_eps_low, 1 + cispo_eps_high))``, and
  ``L_t = -w_t * A_t * pi_t / sg(pi_t)``: its value is ``-w_t * A_t`` (PPO's surrogate where no clip
  binds), its gradient ``-w_t * A_t * grad log pi_t`` for every trainable token. PPO-clip gives a
  token whose ratio left the trust region no gradient at all; that silences exactly the rare
  tokens (a low-probability "wait") whose probability an update moved most.
"""

from __future__ import annotations

import torch
from miles_contracts import AlgorithmParams, TrainBatch

from miles_algorithms.masking import LOG_RATIO_LIMIT, masked, row_mean, trainable

TokenMetrics = dict[str, torch.Tensor]


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, params: AlgorithmParams
) -> tuple[torch.Tensor, TokenMetrics]:
    """``[B, T]`` PPO-clip loss (with optional dual clip) and its clip indicators."""
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - params.eps_clip, 1.0 + params.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": (clipped > unclipped) & mask}
    if params.dual_clip_c is not None:
        bound = -params.dual_clip_c * advantages
        negative = advantages < 0
        metrics["pg_dual_clipfrac"] = negative & (loss > bound) & mask
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    metrics["ratio"] = masked(ratio.detach(), mask)
    return masked(loss, mask), {k: v.float() for k, v in metrics.items()}


def _inputs(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trainable mask, masked advantages and masked log ratio ``log pi - log pi_old`` (all [B, T])."""
    if batch.old_logprobs is None or batch.advantages is None:
        raise ValueError("a policy loss needs batch.old_logprobs and batch.advantages; call it through actor_loss")
    mask = trainable(batch.loss_mask)
    log_ratio = masked(logprobs.float() - batch.old_logprobs.float(), mask)
    return mask, masked(batch.advantages.float(), mask), log_ratio


def ppo_clip(logprobs: torch.Tensor, batch: TrainBatch, params: AlgorithmParams) -> tuple[torch.Tensor, TokenMetrics]:
    """Token-level PPO clip (``train.policy_loss: ppo_clip``)."""
    mask, advantages, log_ratio = _inputs(logprobs, batch)
    ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    return clipped_surrogate(ratio, advantages, mask, params)


def gspo(logprobs: torch.Tensor, batch: TrainBatch, params: AlgorithmParams) -> tuple[torch.Tensor, TokenMetrics]:
    """Sequence-level (geometric mean) ratio, clipped per row (``train.policy_loss: gspo``)."""
    mask, advantages, log_ratio = _inputs(logprobs, batch)
    sequence_log_ratio = row_mean(log_ratio, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B]
    token_logprobs = masked(logprobs.float(), mask)
    log_ratio_t = sequence_log_ratio.detach()[:, None] + token_logprobs - token_logprobs.detach()
    return clipped_surrogate(log_ratio_t.exp(), advantages, mask, params)


def cispo(logprobs: torch.Tensor, batch: TrainBatch, params: AlgorithmParams) -> tuple[torch.Tensor, TokenMetrics]:
    """Clipped, detached importance weight times the policy gradient (``train.policy_loss: cispo``)."""
    mask, advantages, log_ratio = _inputs(logprobs, batch)
    ratio = log_ratio.detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    weight = ratio.clamp(1.0 - params.cispo_eps_low, 1.0 + params.cispo_eps_high)
    token_logprobs = masked(logprobs.float(), mask)
    unit = (token_logprobs - token_logprobs.detach()).exp()  # value 1, gradient grad log pi
    loss = -weight * advantages * unit
    metrics = {"pg_clipfrac": ((weight != ratio) & mask).float(), "ratio": masked(ratio, mask)}
    return masked(loss, mask), metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, TokenMetrics]:
    """``[B, T]`` clipped value loss ``max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)``, 0 off-mask.

    The clipped term keeps one update from moving a value estimate more than ``clip`` away from
    the estimate the advantages were computed with; taking the max makes the clip pessimistic.
    """
    values = masked(values.float(), mask)
    old_values = masked(old_values.float(), mask)
    returns = masked(returns.float(), mask)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    loss = torch.maximum(unclipped_error, clipped_error)
    return masked(loss, mask), {"value_clipfrac": ((clipped_error > unclipped_error) & mask).float()}
