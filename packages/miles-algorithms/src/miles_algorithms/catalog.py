"""What the plugin registers, declared without importing torch.

Collecting a registry is what validating a config does (``miles config show``, a config error,
every ``miles train`` before anything starts), so a spec here holds a stand-in that imports its
implementation -- torch with it, about 4 s of CPU -- at its first call, in the process that runs
it. What a spec declares (``needs_critic``, ``zero_sum_groups``, ``policy_loss``) is read without
that import. The implementations stay where their maths is: :data:`.estimators.ESTIMATORS`,
:data:`.losses.POLICY_LOSSES`, :data:`.corrections.CORRECTIONS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts import (
    AdvantageEstimator,
    AdvantageResult,
    AdvantageSpec,
    AlgorithmParams,
    CorrectionSpec,
    PolicyLossSpec,
)
from miles_contracts.specs import CorrectionFn, PolicyLossFn, TokenMetrics

if TYPE_CHECKING:
    import torch
    from miles_contracts import TrainBatch


def _estimator(name: str) -> AdvantageEstimator:
    def estimate(batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult:
        from miles_algorithms.estimators import ESTIMATORS

        return ESTIMATORS[name](batch, params)

    # the kernel's messages name an estimator by this ("ppo needs critic values: ...")
    estimate.__name__ = estimate.__qualname__ = name
    return estimate


def _policy_loss(name: str) -> PolicyLossFn:
    def loss(logprobs: torch.Tensor, batch: TrainBatch, params: AlgorithmParams) -> tuple[torch.Tensor, TokenMetrics]:
        from miles_algorithms.losses import POLICY_LOSSES

        return POLICY_LOSSES[name](logprobs, batch, params)

    loss.__name__ = loss.__qualname__ = name
    return loss


def _correction(name: str) -> CorrectionFn:
    def correct(proximal_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                params: AlgorithmParams) -> tuple[torch.Tensor, TokenMetrics]:
        from miles_algorithms.corrections import CORRECTIONS

        return CORRECTIONS[name](proximal_logprobs, rollout_logprobs, loss_mask, params)

    correct.__name__ = correct.__qualname__ = name
    return correct


ADVANTAGE_SPECS = {
    "grpo": AdvantageSpec(_estimator("grpo"), zero_sum_groups=True),
    # GSPO is GRPO's advantages *and* the gspo loss's sequence-level ratio: with the token-level
    # ppo_clip loss it would silently be GRPO, so the config is refused with another loss
    "gspo": AdvantageSpec(_estimator("gspo"), zero_sum_groups=True, policy_loss="gspo"),
    "ppo": AdvantageSpec(_estimator("ppo"), needs_critic=True),
    "reinforce_pp": AdvantageSpec(_estimator("reinforce_pp")),
    "reinforce_pp_baseline": AdvantageSpec(_estimator("reinforce_pp_baseline")),
}
"""Advantage estimators (``algorithm.advantage``), each with what it declares."""

POLICY_LOSS_SPECS = {name: PolicyLossSpec(_policy_loss(name)) for name in ("ppo_clip", "gspo", "cispo")}
"""Policy losses (``train.policy_loss``)."""

CORRECTION_SPECS = {name: CorrectionSpec(_correction(name)) for name in ("none", "tis", "mis")}
"""Train/rollout mismatch corrections (``algorithm.correction``)."""
