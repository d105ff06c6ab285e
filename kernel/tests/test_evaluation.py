"""pass@k (hand-computed), accuracy and eval metric naming."""

from __future__ import annotations

import math

import pytest
from miles.evaluation import default_ks, evaluation_metrics, is_correct, metric_name, pass_at_k
from miles_contracts import Sample, Status


def test_pass_at_k_hand_computed() -> None:
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k = 1 is the share correct
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # only one wrong answer: any 2 include a right one


def test_pass_at_k_matches_the_binomial_formula_for_large_n() -> None:
    for n, c, k in [(200, 7, 10), (100, 50, 20), (64, 1, 63)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-9)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match=r"k=5 must be within \[1, n=4\]"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match=r"c=5 must be within \[0, n=4\]"):
        pass_at_k(4, 5, 1)


def test_default_ks_and_names() -> None:
    assert default_ks(1) == [1]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert metric_name("eval", "pass@4") == "eval/pass@4"
    assert metric_name("eval", "accuracy", "gsm8k") == "eval/gsm8k/accuracy"


def scored(*rewards: float | None, status: Status = Status.COMPLETED, length: int = 10) -> list[Sample]:
    return [Sample(reward=r, status=status if r is not None else Status.FAILED, response_length=length) for r in rewards]


def test_evaluation_metrics_hand_computed() -> None:
    groups = [
        scored(1.0, 0.0, 0.0, 1.0),  # c=2 of 4: pass@1 0.5, pass@2 1 - C(2,2)/C(4,2) = 5/6, pass@4 1
        scored(0.0, 0.0, 0.0, None),  # c=0: all 0; one failed sample
        scored(1.0, 1.0, 1.0, 1.0, status=Status.TRUNCATED, length=20),  # c=4
    ]
    metrics = evaluation_metrics(groups, 4)
    assert metrics["num_prompts"] == 3.0
    assert metrics["accuracy"] == pytest.approx(6 / 12)
    assert metrics["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert metrics["pass@2"] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert metrics["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert metrics["reward_mean"] == pytest.approx(6 / 11)  # the failed sample has no reward
    assert metrics["failed_frac"] == pytest.approx(1 / 12)
    assert metrics["truncated_frac"] == pytest.approx(4 / 12)
    assert metrics["response_length_mean"] == pytest.approx((8 * 10 + 4 * 20) / 12)
    assert evaluation_metrics(groups) == metrics  # k defaults to the group size


def test_evaluation_metrics_options() -> None:
    groups = [scored(0.8, 0.4), scored(0.9, 0.9)]
    metrics = evaluation_metrics(groups, ks=[1, 2, 8], threshold=0.85)
    assert metrics["accuracy"] == pytest.approx(2 / 4)
    assert metrics["pass@2"] == pytest.approx(0.5)
    assert "pass@8" not in metrics  # a k larger than the samples per prompt is left out
    assert "pass@4" not in evaluation_metrics(groups, 4)  # asked for 4 per prompt, got 2
    assert evaluation_metrics([]) == {"num_prompts": 0.0}
    assert not is_correct(Sample(reward=float("nan")))
