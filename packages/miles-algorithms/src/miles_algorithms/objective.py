"""The training objective a backend calls: one entry point per phase of a step.

A backend's step, for the batch of one optimizer step (all data-parallel ranks together)::

    batch = compute_advantages(batch, params, spec)        # after the old / ref / critic passes
    batch = prepare_batch(batch)                           # full-batch denominators
    for micro in split(batch):                             # any partition of the rows
        loss, metrics = actor_loss(logprobs(micro), micro, params, policy_loss=..., correction=...)
        loss.backward()                                    # the sum over micro-batches is the batch loss

Every loss and every metric returned by :func:`actor_loss` and :func:`critic_loss` is the
micro-batch's *share* of the full-batch value: sum them over micro-batches (and over
data-parallel ranks) to get the batch's loss and metrics. A data-parallel backend whose gradient
reduction averages over ``W`` ranks must multiply the loss by ``W`` to keep this sum.

Padded ``[B, T]`` and packed ``[1, N]`` batches (see :mod:`miles_algorithms.layout`) are both
accepted; log-prob, entropy and value tensors come in the batch's own layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from miles.advantages import estimate_advantages
from miles_contracts import AdvantageEstimator, AdvantageSpec, AlgorithmParams, TrainBatch
from miles_contracts.specs import CorrectionFn, PolicyLossFn

from miles_algorithms.kl import kl_divergence, masked_kl
from miles_algorithms.layout import Layout
from miles_algorithms.losses import value_loss
from miles_algorithms.masking import trainable
from miles_algorithms.metrics import advantage_metrics, mismatch_metrics
from miles_algorithms.planning import row_lengths, split_rows_evenly
from miles_algorithms.reductions import loss_statistics, reduce, statistics_of

# one optimizer update on a mini-batch: (its metrics summed over ranks, and when asked for, the
# log-probs its forward pass computed before the update, whole over ranks; else None)
Update = Callable[[TrainBatch, bool], tuple[dict[str, float], torch.Tensor | None]]
# what a registered PolicyLossSpec.loss / MismatchCorrectionSpec.correct is
PolicyLoss = PolicyLossFn
Correction = CorrectionFn

__all__ = [
    "actor_loss",
    "advantage_metrics",
    "compute_advantages",
    "critic_loss",
    "kl_divergence",
    "mismatch_metrics",
    "prepare_batch",
    "train_in_mini_batches",
]


def prepare_batch(batch: TrainBatch) -> TrainBatch:
    """Store the full-batch loss denominators in ``batch.extras`` (see :mod:`reductions`).

    Call once on the whole batch of an optimizer step, before splitting it into micro-batches or
    across data-parallel ranks; ``TrainBatch.select`` carries the ``[B]`` statistics along.
    """
    layout = Layout.of(batch)
    rows = layout.batch_rows(batch)
    stats = loss_statistics(trainable(rows.loss_mask), rows.rollout_ids)
    return layout.restore(batch, rows, (), stats)


def train_in_mini_batches(
    batch: TrainBatch, updates: int, update: Update, logprobs: Callable[[TrainBatch], torch.Tensor],
    *, old_from_rollout: bool = False,
) -> dict[str, float]:
    """A train step's ``updates`` optimizer updates, one per mini-batch of ``batch``.

    Rows of one rollout stay in one mini-batch, and the mini-batches get similar token counts.
    With more than one update and no ``old_logprobs`` in the batch, ``logprobs(batch)`` supplies
    them first: after the first update the current policy is no longer the proximal one, and
    every later mini-batch would see ratio 1 and never clip. With a single update, its own
    forward pass gives the pre-update log-probs for the train/inference mismatch metrics.

    ``old_from_rollout``: ``batch.old_logprobs`` are the rollout's own (``train.reuse_rollout_logprobs``),
    so comparing them with the rollout would measure nothing; the mismatch metrics come from the
    first mini-batch's forward instead (the weights before any update of the step, that
    mini-batch's tokens only).

    Returns the update metrics averaged over mini-batches, plus the mismatch metrics.
    """
    rollouts = len(set(batch.rollout_ids.tolist()))
    if updates > rollouts:
        raise ValueError(
            f"train.updates_per_step ({updates}) exceeds the rollouts in the batch ({rollouts}); "
            f"lower updates_per_step or train on more rollouts per step"
        )
    minis = split_rows_evenly(row_lengths(batch.attention_mask), updates, keys=batch.rollout_ids.tolist())
    if batch.old_logprobs is None and len(minis) > 1:
        batch = replace(batch, old_logprobs=logprobs(batch))
    measured = None if old_from_rollout else batch.old_logprobs  # by a trainer pass over the whole batch
    totals: dict[str, float] = {}
    mismatch: dict[str, float] = {}
    for index, rows in enumerate(minis):
        mini = prepare_batch(batch.select(rows))
        metrics, kept = update(mini, index == 0 and measured is None)
        if kept is not None:
            mismatch = mismatch_metrics(kept.to(mini.tokens.device), mini)
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value / len(minis)
    if measured is not None:
        mismatch = mismatch_metrics(measured, batch)
    return totals | mismatch


def compute_advantages(
    batch: TrainBatch, params: AlgorithmParams, estimator: AdvantageSpec | AdvantageEstimator,
) -> TrainBatch:
    """Fill ``advantages`` (and ``returns``) with ``estimator``, then the terms every estimator
    gets: off-mask zeros, batch whitening when ``params.normalize_advantages``, on-policy
    distillation when ``params.opd_coef`` (:func:`miles.advantages.estimate_advantages`, what the
    RL loop runs). Padded or packed batches; a bare estimator counts as ``AdvantageSpec(estimator)``.
    """
    spec = estimator if isinstance(estimator, AdvantageSpec) else AdvantageSpec(estimator)
    layout = Layout.of(batch)
    rows = layout.batch_rows(batch)
    result = estimate_advantages(rows, params, spec)
    rows = replace(rows, advantages=result.advantages, returns=result.returns)
    return layout.restore(batch, rows, ("advantages", "returns"), {})


def actor_loss(
    logprobs: torch.Tensor,
    batch: TrainBatch,
    params: AlgorithmParams,
    *,
    policy_loss: PolicyLoss,
    correction: Correction,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of one micro-batch: its share of the full-batch loss, and metrics (shares too).

    ``loss = reduce(w * policy_loss) - entropy_coef * reduce(H) + kl_loss_coef * reduce(KL)``
    with ``w`` the mismatch correction's weights and ``reduce`` = ``params.loss_reduction``.

    :param logprobs: ``[B, T]`` current log-probs of the micro-batch's tokens (with gradient).
    :param batch: the micro-batch, from a batch that went through :func:`compute_advantages`
        and :func:`prepare_batch`.
    :param policy_loss: a registered policy loss (``kernel.policy_losses().get(name)``).
    :param correction: a registered mismatch correction.
    :param entropy: ``[B, T]`` per-token entropy; needed when ``params.entropy_coef != 0``.
    """
    layout = Layout.of(batch)
    rows = layout.batch_rows(batch)
    logprobs, entropy = layout.to_rows(logprobs), layout.to_rows(entropy)
    _check_shape("logprobs", logprobs, rows)
    if rows.advantages is None:
        raise ValueError("batch.advantages is None: call compute_advantages on the full batch first")
    stats = statistics_of(rows.extras)
    mask = trainable(rows.loss_mask)
    proximal = rows.old_logprobs if rows.old_logprobs is not None else logprobs.detach()
    rows = replace(rows, old_logprobs=proximal)

    def share(values: torch.Tensor, reduction: str = params.loss_reduction) -> torch.Tensor:
        return reduce(values, mask, stats, reduction)

    per_token, token_metrics = policy_loss(logprobs, rows, params)
    weights, correction_metrics = correction(proximal, rows.rollout_logprobs, rows.loss_mask, params)
    pg_loss = share(per_token * weights.detach())
    loss = pg_loss
    metrics = {"pg_loss": pg_loss}
    if entropy is not None:
        _check_shape("entropy", entropy, rows)
        entropy_share = share(entropy.float())
        loss = loss - params.entropy_coef * entropy_share
        metrics["entropy"] = share(entropy.float(), "token_mean")
    elif params.entropy_coef != 0:
        raise ValueError("algorithm.entropy_coef != 0 needs the per-token entropy: pass entropy= to actor_loss")
    if params.kl_loss_coef > 0:
        if rows.ref_logprobs is None:
            raise ValueError("algorithm.kl_loss_coef > 0 needs batch.ref_logprobs: set train.use_reference: true")
        kl_share = share(masked_kl(logprobs, rows.ref_logprobs, mask, params.kl_loss_estimator))
        loss = loss + params.kl_loss_coef * kl_share
        metrics["kl_loss"] = kl_share
    elif rows.ref_logprobs is not None:  # observed, not trained on
        metrics["kl_loss"] = share(masked_kl(logprobs.detach(), rows.ref_logprobs, mask, params.kl_loss_estimator))
    for name, values in {**token_metrics, **correction_metrics}.items():
        metrics[name] = share(values.detach(), "token_mean")
    metrics["loss"] = loss
    return loss, {name: float(value.detach()) for name, value in metrics.items()}


def micro_batch_actor_loss(
    params: AlgorithmParams, *, policy_loss: PolicyLoss, correction: Correction, with_entropy: bool,
) -> Callable[[TrainBatch, tuple[torch.Tensor, ...]], tuple[torch.Tensor, dict[str, float]]]:
    """What a backend calls per micro-batch: ``(micro, (logprobs[, entropy])) -> actor_loss(...)``.

    The entropy enters the loss (and gets a gradient) only when ``params.entropy_coef != 0``;
    otherwise it is a metric only.
    """

    def loss(micro: TrainBatch, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, entropy = outputs[0], (outputs[1] if with_entropy else None)
        if entropy is not None and params.entropy_coef == 0:
            entropy = entropy.detach()
        return actor_loss(logprobs, micro, params, policy_loss=policy_loss, correction=correction, entropy=entropy)

    return loss


def critic_loss(values: torch.Tensor, batch: TrainBatch, params: AlgorithmParams) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of one micro-batch (its share), ``value_loss_coef * reduce(...)``.

    :param values: ``[B, T]`` current critic values (with gradient); ``batch.values`` holds the
        values the advantages were computed with, ``batch.returns`` the targets.
    """
    layout = Layout.of(batch)
    rows = layout.batch_rows(batch)
    values = layout.to_rows(values)
    _check_shape("values", values, rows)
    if rows.values is None or rows.returns is None:
        raise ValueError("critic_loss needs batch.values (old values) and batch.returns: use an estimator with a critic (ppo)")
    stats = statistics_of(rows.extras)
    mask = trainable(rows.loss_mask)
    per_token, token_metrics = value_loss(values, rows.values, rows.returns, mask, params.value_clip)
    unscaled = reduce(per_token, mask, stats, params.loss_reduction)
    loss = params.value_loss_coef * unscaled
    metrics = {"value_loss": unscaled, "value_mean": reduce(values.float().detach(), mask, stats, "token_mean")}
    metrics |= {name: reduce(v, mask, stats, "token_mean") for name, v in token_metrics.items()}
    return loss, {name: float(value.detach()) for name, value in metrics.items()}


def _check_shape(name: str, tensor: torch.Tensor, batch: TrainBatch) -> None:
    if tensor.shape != batch.loss_mask.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but the batch's loss mask is {tuple(batch.loss_mask.shape)}; "
            f"pass {name} aligned with batch.tokens (entry [b, t] for token t)"
        )


