"""Full-batch diagnostics: the train/rollout mismatch and the advantage distribution.

Unlike the loss metrics of :func:`miles_algorithms.objective.actor_loss` (micro-batch shares that
add up), these are plain values of the batch they are given: call them on the full batch.
"""

from __future__ import annotations

import torch
from miles.advantages import advantage_metrics as rows_advantage_metrics
from miles_contracts import TrainBatch

from miles_algorithms.kl import masked_kl
from miles_algorithms.layout import Layout
from miles_algorithms.masking import LOG_RATIO_LIMIT, batch_mean, masked, row_count, row_sum, trainable


def effective_sample_size(weights: torch.Tensor) -> float:
    """``(sum w)^2 / (n * sum w^2)`` of a 1-D tensor of weights: 1 for equal weights, ~1/n for one dominant."""
    if weights.numel() == 0:
        return 1.0
    w = weights.double()
    denominator = w.numel() * w.square().sum()
    return float(w.sum().square() / denominator) if denominator > 0 else 1.0


def mismatch_metrics(logprobs: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
    """How far the trainer's log-probs are from the engine's, on trainable tokens.

    With ``d_t = log pi_train_t - log pi_rollout_t``:

    - ``train_rollout_logprob_abs_diff``: mean ``|d_t|`` (exactly 0 in true on-policy mode);
      ``..._max``: the largest;
    - ``train_rollout_kl``: KL(pi_rollout || pi_train), k3 estimate from the rollout's tokens;
    - ``train_rollout_ess_token`` / ``_sequence``: effective sample size ratio of the token
      weights ``exp(d_t)`` / of the row weights ``exp(sum_t d_t)`` (log weights clamped to +-20).

    :param logprobs: ``[B, T]`` trainer log-probs (e.g. the old-policy pass), layout of ``batch``.
    """
    layout = Layout.of(batch)
    rows = layout.batch_rows(batch)
    logprobs = layout.to_rows(logprobs)
    mask = trainable(rows.loss_mask)
    d = masked(logprobs.detach().float() - rows.rollout_logprobs.float(), mask)
    has_tokens = row_count(mask) > 0
    token_log_w = d[mask].clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    sequence_log_w = row_sum(d, mask)[has_tokens].clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return {
        "train_rollout_logprob_abs_diff": float(batch_mean(d.abs(), mask)),
        "train_rollout_logprob_abs_diff_max": float(d.abs().max()) if mask.any() else 0.0,
        "train_rollout_kl": float(batch_mean(masked_kl(rows.rollout_logprobs, logprobs.detach(), mask, "k3"), mask)),
        "train_rollout_ess_token": effective_sample_size(token_log_w.double().exp()),
        "train_rollout_ess_sequence": effective_sample_size(sequence_log_w.double().exp()),
    }


def advantage_metrics(batch: TrainBatch) -> dict[str, float]:
    """Distribution of the advantages (and returns) over trainable tokens, after compute_advantages
    (:func:`miles.advantages.advantage_metrics` on the batch's rows: padded or packed)."""
    return rows_advantage_metrics(Layout.of(batch).batch_rows(batch))
