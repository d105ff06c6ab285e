"""Loss reductions: hand values, a split rollout counts once, any row partition sums to the whole."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_algorithms.reductions import REDUCTIONS, loss_statistics, reduce

# Per-token losses; 7 sits at masked positions and must never count. Rollout A is row 0,
# rollout B is split over rows 1 and 2, rollout C (row 3) has no trainable token.
LOSSES = torch.tensor([[1.0, 2.0, 7.0], [4.0, 5.0, 7.0], [9.0, 7.0, 7.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
ROLLOUTS = torch.tensor([0, 1, 1, 2])
# N = 5 trainable tokens; K = 2 rollouts with tokens (C does not count); D_A = 2, D_B = 3
#   token_mean              = (1 + 2 + 4 + 5 + 9) / 5           = 21 / 5 = 4.2
#   sequence_mean           = ((1 + 2) / 2 + (4 + 5 + 9) / 3) / 2 = (1.5 + 6) / 2 = 3.75
#   sequence_mean_token_sum = ((1 + 2) + (4 + 5 + 9)) / 2         = 21 / 2 = 10.5
EXPECTED = {"token_mean": 4.2, "sequence_mean": 3.75, "sequence_mean_token_sum": 10.5}


def test_statistics_by_hand():
    stats = loss_statistics(MASK, ROLLOUTS)
    assert stats["loss_total_tokens"].tolist() == [5.0] * 4
    assert stats["loss_total_rollouts"].tolist() == [2.0] * 4
    assert stats["loss_rollout_tokens"].tolist() == [2.0, 3.0, 3.0, 0.0]


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_reductions_by_hand(reduction):
    value = reduce(LOSSES, MASK, loss_statistics(MASK, ROLLOUTS), reduction)
    assert float(value) == pytest.approx(EXPECTED[reduction])


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_split_rollout_counts_once(reduction):
    # rollout B as a single row [4, 5, 9] gives the same value as split over two rows
    losses = torch.tensor([[1.0, 2.0, 0.0], [4.0, 5.0, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    rollouts = torch.tensor([0, 1, 2])
    value = reduce(losses, mask, loss_statistics(mask, rollouts), reduction)
    assert float(value) == pytest.approx(EXPECTED[reduction])


def test_unknown_reduction_names_the_choices():
    with pytest.raises(ValueError, match="choose one of token_mean, sequence_mean, sequence_mean_token_sum"):
        reduce(LOSSES, MASK, loss_statistics(MASK, ROLLOUTS), "mean")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    width=st.integers(1, 7),
    parts=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    reduction=st.sampled_from(list(REDUCTIONS)),
)
def test_any_row_partition_sums_to_the_full_batch(rows, width, parts, seed, reduction):
    g = torch.Generator().manual_seed(seed)
    losses = torch.randn(rows, width, generator=g)
    mask = torch.rand(rows, width, generator=g) < 0.6
    rollouts = torch.randint(0, max(1, rows // 2), (rows,), generator=g)  # some rollouts span rows
    stats = loss_statistics(mask, rollouts)
    full = reduce(losses, mask, stats, reduction)
    assignment = torch.randint(0, parts, (rows,), generator=g)
    total = sum(
        reduce(losses[assignment == p], mask[assignment == p], {k: v[assignment == p] for k, v in stats.items()}, reduction)
        for p in range(parts)
    )
    assert torch.allclose(torch.as_tensor(total), full, atol=1e-5)
