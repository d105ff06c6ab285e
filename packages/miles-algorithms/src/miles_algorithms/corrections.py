"""Train/rollout mismatch corrections (registered by name, ``algorithm.correction``).

The engine that sampled a rollout (pi_rollout) is not numerically the trainer's policy
(pi_old: the trainer's log-probs of the same weights, or the current ones). The importance weight
``w = pi_old / pi_rollout`` corrects the policy gradient for that gap (decoupled PPO: the clip
ratio is taken against pi_old, the weight against the behaviour policy). Levels
(``algorithm.correction_level``), with ``d_t = log pi_old_t - log pi_rollout_t`` on trainable
tokens:

- ``token``: ``w_t = exp(d_t)``;
- ``sequence``: ``w = exp(sum_t d_t)`` for every token of the row (the true sequence ratio;
  high variance on long rows);
- ``geometric``: ``w = exp(mean_t d_t)`` for every token of the row (length-normalised).

Log weights are clamped to +-20 before ``exp``. Modes, bounds ``[low, high]`` =
``[correction_low, correction_high]``:

- ``none``: ``w = 1``;
- ``tis`` (truncate): ``w = clip(w, low, high)``: bounded variance, small bias;
- ``mis`` (mask): ``w`` inside the bounds, 0 outside: drops tokens (or whole rows at sequence
  and geometric level) the engine sampled from a distribution too far from the trainer's.

A correction is ``(proximal_logprobs, rollout_logprobs, loss_mask, params) -> (weights [B, T],
token_metrics)``; weights are detached and 0 off-mask; they multiply the per-token policy loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from miles_contracts import AlgorithmParams

from miles_algorithms.masking import LOG_RATIO_LIMIT, masked, row_mean, row_sum, trainable

TokenMetrics = dict[str, torch.Tensor]


def _token(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return d


def _sequence(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return row_sum(d, mask)[:, None].expand_as(d)


def _geometric(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return row_mean(d, mask)[:, None].expand_as(d)


LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token,
    "sequence": _sequence,
    "geometric": _geometric,
}


def importance_weights(
    proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """``[B, T]`` detached weights ``pi_old / pi_rollout`` at ``level``, 0 off-mask."""
    try:
        aggregate = LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown correction level {level!r}; choose one of {', '.join(LEVELS)}") from None
    d = masked(proximal_logprobs.detach().float() - rollout_logprobs.detach().float(), mask)
    log_w = aggregate(d, mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return masked(log_w.exp(), mask)


def no_correction(
    proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, params: AlgorithmParams
) -> tuple[torch.Tensor, TokenMetrics]:
    """``none``: weight 1 on every trainable token."""
    mask = trainable(loss_mask)
    return mask.float(), {}


def truncated_importance_sampling(
    proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, params: AlgorithmParams
) -> tuple[torch.Tensor, TokenMetrics]:
    """``tis``: weights clipped to ``[correction_low, correction_high]``."""
    mask = trainable(loss_mask)
    raw = importance_weights(proximal_logprobs, rollout_logprobs, mask, params.correction_level)
    outside = ((raw < params.correction_low) | (raw > params.correction_high)) & mask
    weights = masked(raw.clamp(params.correction_low, params.correction_high), mask)
    return weights, {"correction_weight": weights, "correction_clipfrac": outside.float()}


def masked_importance_sampling(
    proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, params: AlgorithmParams
) -> tuple[torch.Tensor, TokenMetrics]:
    """``mis``: weights kept inside ``[correction_low, correction_high]``, 0 outside."""
    mask = trainable(loss_mask)
    raw = importance_weights(proximal_logprobs, rollout_logprobs, mask, params.correction_level)
    keep = (raw >= params.correction_low) & (raw <= params.correction_high) & mask
    weights = masked(raw, keep)
    return weights, {"correction_weight": weights, "correction_maskfrac": (mask & ~keep).float()}


CORRECTIONS = {
    "none": no_correction,
    "tis": truncated_importance_sampling,
    "mis": masked_importance_sampling,
}
