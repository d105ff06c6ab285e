"""Batch builders for the algorithm tests: tensors written out row by row."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from miles_contracts import TrainBatch


def build_batch(
    loss_mask: Sequence[Sequence[float]],
    *,
    rewards: Sequence[float] | None = None,
    group_ids: Sequence[int] | None = None,
    rollout_ids: Sequence[int] | None = None,
    **per_token: Sequence[Sequence[float]] | None,
) -> TrainBatch:
    """A ``[B, T]`` batch from nested lists; ids default to one group, one rollout per row."""
    mask = torch.tensor(loss_mask, dtype=torch.float32)
    b, t = mask.shape
    tensors = {k: None if v is None else torch.tensor(v, dtype=torch.float32) for k, v in per_token.items()}
    rollout_logprobs = tensors.pop("rollout_logprobs", None)
    return TrainBatch(
        tokens=torch.arange(b * t).reshape(b, t),
        attention_mask=torch.ones(b, t, dtype=torch.long),
        loss_mask=mask,
        rollout_logprobs=torch.zeros(b, t) if rollout_logprobs is None else rollout_logprobs,
        rewards=torch.tensor(rewards if rewards is not None else [0.0] * b, dtype=torch.float32),
        group_ids=torch.tensor(group_ids if group_ids is not None else [0] * b),
        rollout_ids=torch.tensor(rollout_ids if rollout_ids is not None else list(range(b))),
        **tensors,
    )


@pytest.fixture
def make_batch():
    return build_batch
