"""The math reward: symbolic equivalence through math-verify in worker processes (real ones)."""

from __future__ import annotations

import asyncio
import math

import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards import score_samples_blocking
from miles.sections import RewardSection
from miles_contracts import Process, Sample, Status
from miles_contracts.testing.reward import check_reward
from miles_rm_math import MathReward
from miles_rm_math.reward import shared_pool


def sample(response: str, label: str | None, index: int = 0) -> Sample:
    return Sample(prompt="q", response=response, label=label, status=Status.COMPLETED, index=index)


@pytest.fixture(scope="module", autouse=True)
def stop_workers():
    yield
    shared_pool().close()


@pytest.mark.slow  # the first test starts the worker processes (each imports sympy and math-verify)
def test_equivalent_answers_score_one() -> None:
    cases = [
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # fraction vs decimal
        ("So we get $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),  # unreduced fraction
        ("Therefore \\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),  # expanded polynomial
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("Final answer: 72", "72", 1.0),
        ("I think \\boxed{71}", "72", 0.0),
        ("no answer at all", "72", 0.0),
        ("first \\boxed{3} then corrected to \\boxed{4}", "4", 1.0),  # the last box counts
    ]
    scores = asyncio.run(MathReward()([sample(r, label, i) for i, (r, label, _) in enumerate(cases)]))
    assert scores == [expected for *_, expected in cases]


def test_unscorable_samples_are_nan() -> None:
    scores = asyncio.run(MathReward()([sample("\\boxed{1}", None), sample("\\boxed{1}", "")]))
    assert all(math.isnan(s) for s in scores)


def test_math_reward_conforms() -> None:
    check_reward(MathReward())


def test_checks_past_the_deadline_are_nan_and_do_not_end_the_run() -> None:
    # A fresh pool has to start its workers (spawn + sympy import) first, which takes far longer
    # than this deadline: every check misses it, the samples are marked, nothing raises.
    from miles.rewards import WorkerPool

    pool = WorkerPool(processes=1)
    try:
        scores = asyncio.run(MathReward(deadline=0.001, pool=pool)([sample("\\boxed{1}", "1")]))
        assert math.isnan(scores[0])
        assert pool.restarts == 1
    finally:
        pool.close()


def test_registered_as_math_and_used_by_score() -> None:
    selection = PluginSelection(enable=("rm_math",))
    kernel = Kernel(load_plugins(selection), selection)
    samples = [sample("\\boxed{\\frac{3}{6}}", "1/2", 0), sample("\\boxed{3}", "4", 1)]
    samples.append(Sample(prompt="q", response="\\boxed{1}", label=None, status=Status.COMPLETED, index=2))
    ctx = context_for(MilesConfig(reward=RewardSection(name="math")), Process.driver(), kernel=kernel)
    report = score_samples_blocking(samples, ctx)
    assert [s.reward for s in samples[:2]] == [1.0, 0.0]
    assert samples[2].status is Status.FAILED and "returned nan" in samples[2].exit_detail
    assert (report.scored, report.failed) == (2, 1)
