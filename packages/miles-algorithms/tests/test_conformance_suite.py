"""The advantage conformance suite itself: it must catch each kind of broken estimator (each given as a
plugin registers it, in an ``AdvantageSpec``) and each way a kernel stage could drop its terms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from miles.advantages import estimate_advantages
from miles_algorithms.catalog import ADVANTAGE_SPECS
from miles_contracts import AdvantageResult, AdvantageSpec
from miles_contracts.testing.advantage import check_advantage


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


def whitens_itself(batch, params):
    advantages = raw_reward(batch, params).advantages
    if params.normalize_advantages:  # the kernel's job: this run would be whitened twice
        mask = batch.loss_mask > 0
        advantages = torch.where(mask, (advantages - advantages[mask].mean()) / advantages[mask].std(), 0.0)
    return AdvantageResult(advantages)


def distils_itself(batch, params):
    advantages = raw_reward(batch, params).advantages
    if params.opd_coef > 0:  # the kernel's job: this run would distil twice
        advantages = advantages + params.opd_coef * (batch.teacher_logprobs - batch.old_logprobs) * batch.loss_mask
    return AdvantageResult(advantages)


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
        (whitens_itself, "advantages changed with normalize_advantages / opd_coef.*must not apply them itself"),
        (distils_itself, "advantages changed with normalize_advantages / opd_coef.*must not apply them itself"),
    ],
)
def test_suite_catches_broken_estimators(fn, message):
    with pytest.raises(AssertionError, match=message):
        check_advantage(AdvantageSpec(fn))


def test_suite_checks_group_zero_sum_when_the_spec_declares_it():
    check_advantage(AdvantageSpec(raw_reward))  # no zero-sum contract: passes
    with pytest.raises(AssertionError, match="sum to .* expected 0"):
        check_advantage(AdvantageSpec(raw_reward, zero_sum_groups=True))


def test_suite_takes_the_registered_spec_and_checks_its_declarations():
    def plain(batch, params):
        return AdvantageResult(torch.zeros(batch.loss_mask.shape))

    with pytest.raises(AssertionError, match="takes the AdvantageSpec a plugin registers"):
        check_advantage(plain)
    with pytest.raises(AssertionError, match="needs_critic must be a bool"):
        check_advantage(AdvantageSpec(plain, needs_critic="yes"))
    check_advantage(AdvantageSpec(plain))


def test_suite_gives_a_critic_estimator_values():
    def reads_values(batch, params):
        return AdvantageResult(torch.where(batch.loss_mask > 0, batch.values.clamp(-1, 1), 0.0))

    check_advantage(AdvantageSpec(reads_values, needs_critic=True))
    with pytest.raises(AttributeError):  # no values without the declaration
        check_advantage(AdvantageSpec(reads_values))


def test_suite_reads_the_zero_sum_contract_from_the_spec():
    assert ADVANTAGE_SPECS["grpo"].zero_sum_groups is True
    check_advantage(ADVANTAGE_SPECS["grpo"])


def test_the_kernel_stage_passes_and_a_stage_without_the_kernel_terms_is_caught():
    check_advantage(AdvantageSpec(raw_reward), stage=estimate_advantages)

    def forgets_to_whiten(batch, params, spec):
        return estimate_advantages(batch, params.model_copy(update={"normalize_advantages": False}), spec)

    def forgets_to_distil(batch, params, spec):
        return estimate_advantages(batch, params.model_copy(update={"opd_coef": 0.0}), spec)

    def invents_returns(batch, params, spec):
        result = estimate_advantages(batch, params, spec)
        return replace(result, returns=result.advantages)

    message = r"not the estimator's own whitened plus opd_coef \* \(teacher - student\)"
    for stage in (forgets_to_whiten, forgets_to_distil):
        with pytest.raises(AssertionError, match=message):
            check_advantage(AdvantageSpec(raw_reward), stage=stage)
    with pytest.raises(AssertionError, match="returns appeared"):
        check_advantage(AdvantageSpec(raw_reward), stage=invents_returns)
