"""The advantage stage of an RL step, the same for every estimator. Runs in the driver.

::

    result = spec.estimator(batch, params)         # the estimator's own method (GRPO, GAE ...)
    A = result.advantages, 0 off-mask              # whatever the estimator left there
    A = whiten(A)                                  # algorithm.normalize_advantages
    A += opd_coef * (log pi_teacher - log pi_student)   # algorithm.opd_coef (on-policy distillation)

An estimator registered by any package (an :class:`~miles_contracts.AdvantageSpec`) gets exactly
these terms, applied here once: before 0.2 the built-in estimators were registered wrapped in
them, and a third-party one silently went without. Padded ``[B, T]`` batches (what the learner
builds); ``miles_algorithms.objective.compute_advantages`` views a packed batch as rows first.

torch is imported when the stage runs, not with this module.
"""

from __future__ import annotations

from dataclasses import replace
from types import FunctionType
from typing import TYPE_CHECKING

from miles_contracts import AdvantageResult, AdvantageSpec, AlgorithmParams, TrainBatch

if TYPE_CHECKING:
    import torch


def estimate_advantages(batch: TrainBatch, params: AlgorithmParams, spec: AdvantageSpec) -> AdvantageResult:
    """``spec``'s estimator on ``batch``, then the terms every estimator gets (module docstring).

    :returns: ``[B, T]`` advantages and returns (0 off-mask, detached) and metrics: the
        estimator's own, then the distribution of the final advantages over trainable tokens
        (``advantage_mean``, ``_std``, ``_min``, ``_max``, ``return_mean``).
    :raises ValueError: the estimator needs critic values the batch lacks, returned advantages of
        another shape than the loss mask, or distillation is on without teacher log-probs.
    """
    # a function's own name (a stand-in that imports its estimator lazily is named after it), else its class's
    estimator = spec.estimator
    name = estimator.__name__ if isinstance(estimator, FunctionType) else type(estimator).__name__
    if spec.needs_critic and batch.values is None:
        raise ValueError(f"{name} needs critic values: run the critic pass (train.use_critic: true)")
    result = spec.estimator(batch, params)
    mask = batch.loss_mask > 0
    if result.advantages.shape != mask.shape:
        raise ValueError(
            f"{name} returned advantages of shape {tuple(result.advantages.shape)}, "
            f"expected {tuple(mask.shape)} ([B, T] like the loss mask)"
        )
    advantages = masked(result.advantages.float(), mask)
    if params.normalize_advantages:
        advantages = whiten(advantages, mask)
    if params.opd_coef > 0:
        advantages = advantages + params.opd_coef * distillation_term(batch, mask)
    final = advantages.detach()
    returns = None if result.returns is None else masked(result.returns.float(), mask).detach()
    done = replace(batch, advantages=final, returns=returns)
    return AdvantageResult(final, returns, {**result.metrics, **advantage_metrics(done)})


def distillation_term(batch: TrainBatch, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: ``log pi_teacher - log pi_student`` on trainable tokens (a reverse-KL reward);
    the student is ``old_logprobs``, else ``rollout_logprobs``."""
    if batch.teacher_logprobs is None:
        raise ValueError("algorithm.opd_coef > 0 needs teacher log-probs (batch.teacher_logprobs is None)")
    student = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    return masked(batch.teacher_logprobs.float(), mask) - masked(student.float(), mask)


def advantage_metrics(batch: TrainBatch) -> dict[str, float]:
    """Distribution of ``batch.advantages`` (and ``returns``) over trainable tokens."""
    if batch.advantages is None:
        raise ValueError("batch.advantages is None: compute the advantages first")
    mask = batch.loss_mask > 0
    a = batch.advantages.float()
    mean = _batch_mean(a, mask)
    metrics = {
        "advantage_mean": float(mean),
        "advantage_std": float(_batch_mean((a - mean).square(), mask).sqrt()),
        "advantage_min": float(a[mask].min()) if mask.any() else 0.0,
        "advantage_max": float(a[mask].max()) if mask.any() else 0.0,
    }
    if batch.returns is not None:
        metrics["return_mean"] = float(_batch_mean(batch.returns.float(), mask))
    return metrics


def masked(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` where ``mask``, ``fill`` elsewhere (gradient flows only through masked-in entries).

    ``torch.where``, never a multiplication by the mask: off-mask entries may hold anything, and
    ``nan * 0`` is nan."""
    import torch

    return torch.where(mask, x, torch.full_like(x, fill))


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``[B, T]``: (x - mean) / (std + eps) over masked-in entries, 0 off-mask.

    Statistics in float64 so rewards of 1e6 and sums over millions of tokens stay exact enough.
    """
    x64 = masked(x.double(), mask)
    count = mask.sum().clamp(min=1).double()
    mean = x64.sum() / count
    var = masked((x64 - mean) ** 2, mask).sum() / count
    out = (x64 - mean) / (var.sqrt() + eps)
    return masked(out, mask).to(x.dtype)


def _batch_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum() / mask.sum().clamp(min=1).to(x.dtype)


__all__ = ["advantage_metrics", "distillation_term", "estimate_advantages", "masked", "whiten"]
