"""Loss reductions that count a rollout once and decompose over micro-batches.

A backend splits a step's batch into micro-batches of rows and sums their losses (gradient
accumulation). Every reduction here is therefore a *sum over rows* of the row's masked token sum
divided by denominators measured once on the full batch (:func:`loss_statistics`, stored in
``batch.extras`` by :func:`miles_algorithms.objective.prepare_batch`). Any partition of the rows
gives losses that add up to the full-batch loss.

With ``l_t`` the per-token loss, ``N`` the trainable tokens of the batch, ``K`` the rollouts with
at least one trainable token, and ``D_r`` the trainable tokens of rollout ``r`` over all its rows:

- ``token_mean``: ``sum_t l_t / N`` (every token weighs the same; long rollouts weigh more);
- ``sequence_mean``: ``(1/K) sum_r (1/D_r) sum_{t in r} l_t`` (every rollout weighs the same,
  however long and however many rows it was split into);
- ``sequence_mean_token_sum``: ``(1/K) sum_r sum_{t in r} l_t`` (no length normalisation:
  Dr.GRPO's unbiased form up to a constant factor, which only rescales the learning rate).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles_algorithms.masking import row_count, row_sum

TOTAL_TOKENS = "loss_total_tokens"
"""extras key: ``[B]`` float, N (the same in every row)."""
TOTAL_ROLLOUTS = "loss_total_rollouts"
"""extras key: ``[B]`` float, K (the same in every row)."""
ROLLOUT_TOKENS = "loss_rollout_tokens"
"""extras key: ``[B]`` float, D_r of the row's rollout."""
STATISTICS = (TOTAL_TOKENS, TOTAL_ROLLOUTS, ROLLOUT_TOKENS)


def loss_statistics(mask: torch.Tensor, rollout_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The full-batch denominators, one ``[B]`` float32 tensor each (keys :data:`STATISTICS`)."""
    per_row = row_count(mask)  # [B]
    _, row_to_rollout = torch.unique(rollout_ids, return_inverse=True)
    per_rollout = torch.zeros(int(row_to_rollout.max().item()) + 1 if len(rollout_ids) else 0, device=mask.device)
    per_rollout = per_rollout.index_add(0, row_to_rollout, per_row)
    ones = torch.ones_like(per_row)
    return {
        TOTAL_TOKENS: ones * per_row.sum(),
        TOTAL_ROLLOUTS: ones * (per_rollout > 0).sum().float(),
        ROLLOUT_TOKENS: per_rollout[row_to_rollout],
    }


def _token_mean(row_sums: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    return (row_sums / stats[TOTAL_TOKENS].clamp(min=1)).sum()


def _sequence_mean(row_sums: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    return (row_sums / (stats[ROLLOUT_TOKENS].clamp(min=1) * stats[TOTAL_ROLLOUTS].clamp(min=1))).sum()


def _sequence_mean_token_sum(row_sums: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    return (row_sums / stats[TOTAL_ROLLOUTS].clamp(min=1)).sum()


REDUCTIONS: dict[str, Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]] = {
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
    "sequence_mean_token_sum": _sequence_mean_token_sum,
}


def statistics_of(extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The denominators stored by ``prepare_batch``; a clear error when they are missing."""
    missing = [key for key in STATISTICS if key not in extras]
    if missing:
        raise ValueError(
            f"batch.extras lacks {', '.join(missing)}: call miles_algorithms.objective.prepare_batch(batch) "
            "once on the full batch of an optimizer step, before splitting it into micro-batches"
        )
    return {key: extras[key] for key in STATISTICS}


def reduce(values: torch.Tensor, mask: torch.Tensor, stats: dict[str, torch.Tensor], reduction: str) -> torch.Tensor:
    """Scalar: this micro-batch's share of the full-batch ``reduction`` of ``values [B, T]``."""
    try:
        fn = REDUCTIONS[reduction]
    except KeyError:
        raise ValueError(f"unknown loss reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}") from None
    return fn(row_sum(values, mask), stats)
