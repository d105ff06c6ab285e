"""The advantage conformance suite itself: it must catch each kind of broken estimator."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from miles_algorithms.estimators import GRPO
from miles_contracts import AdvantageResult
from miles_contracts.testing.advantage import check_advantage


class Broken:
    needs_critic: ClassVar[bool] = False

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__

    def __call__(self, batch, params):
        return self.fn(batch, params)


def leaks_off_mask(batch, params):
    return AdvantageResult(batch.rewards[:, None].expand_as(batch.loss_mask).clone())


def reads_masked_inputs(batch, params):
    baseline = batch.old_logprobs.mean()  # includes prompt and tool positions
    return AdvantageResult((batch.rewards[:, None] - baseline) * batch.loss_mask)


def writes_to_the_batch(batch, params):
    batch.rewards.mul_(2.0)
    return AdvantageResult(batch.rewards[:, None] * batch.loss_mask)


def is_random(batch, params):
    return AdvantageResult(torch.randn(batch.loss_mask.shape) * batch.loss_mask)


def overflows(batch, params):
    ratio = (batch.old_logprobs - batch.ref_logprobs).exp()  # no clamp: e^1e4 = inf
    return AdvantageResult(torch.where(batch.loss_mask > 0, ratio, 0.0))


def wrong_shape(batch, params):
    return AdvantageResult(batch.rewards.clone())


def depends_on_row_order(batch, params):
    position = torch.arange(batch.size, dtype=torch.float32)[:, None]
    return AdvantageResult(position * batch.loss_mask)


def raw_reward(batch, params):
    return AdvantageResult(batch.rewards[:, None] * batch.loss_mask)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (leaks_off_mask, "must be 0 where loss_mask is 0"),
        (reads_masked_inputs, "changed when only inputs at masked positions"),
        (writes_to_the_batch, "modified its input batch.rewards"),
        (is_random, "two calls on the same batch gave different advantages"),
        (overflows, "non-finite entries"),
        (wrong_shape, r"has shape \(8,\), expected \(8, 14\)"),
        (depends_on_row_order, "permuting the rows did not permute advantages"),
    ],
)
def test_suite_catches_broken_estimators(fn, message):
    with pytest.raises(AssertionError, match=message):
        check_advantage(Broken(fn))


def test_suite_checks_group_zero_sum_when_asked():
    check_advantage(Broken(raw_reward))  # no zero-sum contract: passes
    with pytest.raises(AssertionError, match="sum to .* expected 0"):
        check_advantage(Broken(raw_reward), zero_sum_groups=True)


def test_suite_requires_needs_critic():
    def plain(batch, params):
        return AdvantageResult(torch.zeros(batch.loss_mask.shape))

    with pytest.raises(AssertionError, match="needs_critic must be a bool"):
        check_advantage(plain)


def test_suite_reads_the_zero_sum_contract_from_the_estimator():
    assert GRPO.zero_sum_groups is True
    check_advantage(GRPO())
