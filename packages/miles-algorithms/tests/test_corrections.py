"""Mismatch corrections none / tis / mis at token, sequence and geometric level, and the metrics."""

from __future__ import annotations

import math

import pytest
import torch
from miles_algorithms.corrections import CORRECTIONS, importance_weights
from miles_algorithms.metrics import effective_sample_size, mismatch_metrics
from miles_contracts import AlgorithmParams

LN2, LN4 = math.log(2), math.log(4)
E01, E02 = math.exp(0.1), math.exp(0.2)
# d = log pi_old - log pi_rollout on trainable tokens:
#   row 0: ln2, -ln2, ln4, (masked)   -> token weights 2, 0.5, 4
#   row 1: 0.1, 0.1, (masked) x2      -> token weights e^0.1 = 1.1051709 twice
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.7, 0.0, 0.0]])
PROXIMAL = ROLLOUT + torch.tensor([[LN2, -LN2, LN4, 1e4], [0.1, 0.1, -1e4, float("nan")]])


def weights(name, level, low=0.0, high=2.0):
    params = AlgorithmParams(correction=name, correction_level=level, correction_low=low, correction_high=high)
    return CORRECTIONS[name](PROXIMAL, ROLLOUT, MASK, params)


def test_raw_weights_at_each_level():
    mask = MASK > 0
    token = importance_weights(PROXIMAL, ROLLOUT, mask, "token")
    # sequence: row 0 exp(ln2 - ln2 + ln4) = 4; row 1 exp(0.2)
    sequence = importance_weights(PROXIMAL, ROLLOUT, mask, "sequence")
    # geometric: row 0 exp(ln4 / 3) = 4^(1/3) = 1.5874011; row 1 exp(0.2 / 2) = e^0.1
    geometric = importance_weights(PROXIMAL, ROLLOUT, mask, "geometric")
    assert torch.allclose(token, torch.tensor([[2.0, 0.5, 4.0, 0.0], [E01, E01, 0.0, 0.0]]))
    assert torch.allclose(sequence, torch.tensor([[4.0, 4.0, 4.0, 0.0], [E02, E02, 0.0, 0.0]]))
    assert torch.allclose(geometric, torch.tensor([[1.5874011] * 3 + [0.0], [E01, E01, 0.0, 0.0]]))


def test_none_is_one_on_trainable_tokens():
    w, metrics = weights("none", "token")
    assert w.tolist() == MASK.tolist() and metrics == {}


@pytest.mark.parametrize(
    ("level", "expected", "clipped"),
    [
        # token: 4 -> 2 (one of five tokens truncated)
        ("token", [[2.0, 0.5, 2.0, 0.0], [E01, E01, 0.0, 0.0]], [[0, 0, 1, 0], [0, 0, 0, 0]]),
        # sequence: row 0's 4 -> 2 on all three tokens
        ("sequence", [[2.0, 2.0, 2.0, 0.0], [E02, E02, 0.0, 0.0]], [[1, 1, 1, 0], [0, 0, 0, 0]]),
        # geometric: 1.587 and 1.105 are inside [0, 2]
        ("geometric", [[1.5874011] * 3 + [0.0], [E01, E01, 0.0, 0.0]], [[0, 0, 0, 0], [0, 0, 0, 0]]),
    ],
)
def test_tis_truncates(level, expected, clipped):
    w, metrics = weights("tis", level, low=0.0, high=2.0)
    assert torch.allclose(w, torch.tensor(expected))
    assert metrics["correction_clipfrac"].tolist() == clipped


@pytest.mark.parametrize(
    ("level", "low", "high", "expected"),
    [
        # token, bounds [0.5, 2]: 4 is out -> 0; 0.5 is on the bound -> kept
        ("token", 0.5, 2.0, [[2.0, 0.5, 0.0, 0.0], [E01, E01, 0.0, 0.0]]),
        # sequence: row 0 (4) is out -> the whole row is dropped
        ("sequence", 0.5, 2.0, [[0.0, 0.0, 0.0, 0.0], [E02, E02, 0.0, 0.0]]),
        # geometric, bounds [0.9, 1.2]: row 0 (1.587) dropped, row 1 (1.105) kept
        ("geometric", 0.9, 1.2, [[0.0, 0.0, 0.0, 0.0], [E01, E01, 0.0, 0.0]]),
    ],
)
def test_mis_masks_outside_the_bounds(level, low, high, expected):
    w, metrics = weights("mis", level, low=low, high=high)
    assert torch.allclose(w, torch.tensor(expected))
    dropped = ((torch.tensor(expected) == 0) & (MASK > 0)).float()
    assert metrics["correction_maskfrac"].tolist() == dropped.tolist()


def test_extreme_mismatch_stays_finite():
    proximal = torch.tensor([[0.0, -1e4, 0.0]])
    rollout = torch.tensor([[-1e4, 0.0, 0.0]])
    mask = torch.ones(1, 3)
    for name in CORRECTIONS:
        for level in ("token", "sequence", "geometric"):
            params = AlgorithmParams(correction=name, correction_level=level)
            w, _ = CORRECTIONS[name](proximal, rollout, mask, params)
            assert torch.isfinite(w).all(), (name, level)


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="unknown correction level 'row'"):
        importance_weights(PROXIMAL, ROLLOUT, MASK > 0, "row")


def test_effective_sample_size_by_hand():
    # equal weights: (4 * 1)^2 / (4 * 4) = 1;  one dominant weight tends to 1/n
    assert effective_sample_size(torch.ones(4)) == 1.0
    assert effective_sample_size(torch.tensor([1e9, 1.0, 1.0, 1.0])) == pytest.approx(0.25, rel=1e-6)
    # weights 2, 0.5, 4, e^0.1, e^0.1: sum 8.7103418, sum of squares 22.6928055
    #   ESS = 8.7103418^2 / (5 * 22.6928055) = 0.6686706
    w = torch.tensor([2.0, 0.5, 4.0, E01, E01])
    assert effective_sample_size(w) == pytest.approx(0.6686706, rel=1e-6)


def test_mismatch_metrics_by_hand(make_batch):
    batch = make_batch(MASK.tolist(), rollout_logprobs=ROLLOUT.tolist())
    metrics = mismatch_metrics(PROXIMAL, batch)
    # |d|: (ln2 + ln2 + ln4 + 0.1 + 0.1) / 5 = 0.5945177
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.5945177, rel=1e-5)
    assert metrics["train_rollout_logprob_abs_diff_max"] == pytest.approx(LN4, rel=1e-6)
    # KL(rollout || train), k3 with x = -d: e^d - 1 - d = 0.3068528, 0.1931472, 1.6137056, 0.0051709 x2
    #   mean 2.1240474 / 5 = 0.4248095
    assert metrics["train_rollout_kl"] == pytest.approx(0.4248095, rel=1e-5)
    assert metrics["train_rollout_ess_token"] == pytest.approx(0.6686706, rel=1e-5)
    # sequence weights 4 and e^0.2: (5.2214028)^2 / (2 * (16 + 1.4918247)) = 0.7793083
    assert metrics["train_rollout_ess_sequence"] == pytest.approx(0.7793083, rel=1e-5)


def test_identical_logprobs_give_zero_mismatch(make_batch):
    batch = make_batch(MASK.tolist(), rollout_logprobs=ROLLOUT.tolist())
    metrics = mismatch_metrics(ROLLOUT.clone(), batch)
    assert metrics["train_rollout_logprob_abs_diff"] == 0.0 and metrics["train_rollout_kl"] == 0.0
    assert metrics["train_rollout_ess_token"] == 1.0 and metrics["train_rollout_ess_sequence"] == 1.0
