"""DAPO's soft overlong penalty (``reward.overlong``), checked by hand on a small example."""

from __future__ import annotations

import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards import score_samples_blocking
from miles.sections import OverlongPenalty, RewardSection
from miles_contracts import Sample, Status
from pydantic import ValidationError


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("rewards",))
    return Kernel(load_plugins(selection), selection)


def answered(model_tokens: int, *, tool_tokens: int = 0, response: str = "4") -> Sample:
    """A correct answer ("4" for label "4": exact_match 1.0) whose response holds ``model_tokens``
    sampled tokens, then ``tool_tokens`` of tool output (loss mask 0)."""
    mask = [1] * model_tokens + [0] * tool_tokens
    return Sample(prompt="2+2?", label="4", response=response, tokens=[7] * (3 + len(mask)), response_length=len(mask),
                  loss_mask=mask, status=Status.COMPLETED)


def test_the_penalty_by_hand(kernel: Kernel) -> None:
    """L_max = 20, L_cache = 8, so the penalty starts after 20 - 8 = 12 model tokens:

    ====  ==========================  =======
    |y|   by hand                     penalty
    ====  ==========================  =======
    10    10 <= 12                    0
    12    12 <= 12                    0
    14    (12 - 14) / 8 = -2/8        -0.25
    16    (12 - 16) / 8 = -4/8        -0.5
    20    (12 - 20) / 8 = -8/8        -1
    25    25 > 20                     -1
    ====  ==========================  =======

    The rewards are exact_match's 1.0 plus the penalty; the last sample (14 model tokens and 16
    tokens of tool output, response_length 30) is penalised for its 14 model tokens only.
    """
    samples = [answered(n) for n in (10, 12, 14, 16, 20, 25)] + [answered(14, tool_tokens=16)]
    config = MilesConfig(reward=RewardSection(name="exact_match", overlong=OverlongPenalty(max_length=20, buffer=8)))
    report = score_samples_blocking(samples, context_for(config, kernel=kernel))
    assert [s.reward for s in samples] == [1.0, 1.0, 0.75, 0.5, 0.0, 0.0, 0.75]
    assert [s.metadata.get("overlong_penalty") for s in samples] == [None, None, -0.25, -0.5, -1.0, -1.0, -0.25]
    assert report.metrics()["reward/overlong_penalized"] == 5.0


def test_the_factor_scales_it_and_a_wrong_answer_is_penalised_too(kernel: Kernel) -> None:
    """factor 0.5: 16 tokens -> 0.5 * (12 - 16) / 8 = -0.25; a wrong answer (0.0) of 16 tokens -> -0.25."""
    samples = [answered(16), answered(16, response="5")]
    overlong = OverlongPenalty(max_length=20, buffer=8, factor=0.5)
    score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(overlong=overlong)), kernel=kernel))
    assert [s.reward for s in samples] == [0.75, -0.25]


def test_off_by_default(kernel: Kernel) -> None:
    samples = [answered(5000)]
    report = score_samples_blocking(samples, context_for(MilesConfig(), kernel=kernel))
    assert samples[0].reward == 1.0 and report.metrics()["reward/overlong_penalized"] == 0.0


def test_a_buffer_longer_than_max_length_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"reward.overlong.buffer \(30\) is larger than reward.overlong.max_length \(20\)"):
        OverlongPenalty(max_length=20, buffer=30)
