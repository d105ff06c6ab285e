"""`policy_update`: one RL step's optimiser updates, the same for every train backend.

A backend says how to run its models (a :class:`Trainee` per trained model: forward + backward
over micro-batches, then the optimiser step); this module does everything else, once::

    check the batch (advantages; returns with a critic)
    policy loss + mismatch correction from the registries, entropy only when it is logged or trained
    for each of train.updates_per_step mini-batches (rows of one rollout together):
        actor:  accumulate(mini, actor loss)  -> step()
        critic: accumulate(mini, value loss)  -> step()      (when the backend trains one)
    metrics averaged over mini-batches, the train/rollout mismatch, train_tokens

Runs in every trainer rank (SPMD: every rank calls it with the same batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch
from miles_contracts import TrainBatch

from miles_algorithms import objective

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.kernel import Kernel

MicroLoss = Callable[[TrainBatch, tuple[torch.Tensor, ...]], tuple[torch.Tensor, dict[str, float]]]
"""``(micro-batch, model outputs) -> (loss share, metric shares)``."""


class Trainee(Protocol):
    """One model a backend trains (the actor, a critic), as :func:`policy_update` drives it."""

    def accumulate(self, batch: TrainBatch, loss: MicroLoss, *, with_entropy: bool,
                   keep_outputs: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        """Forward + backward of every micro-batch of ``batch`` (this rank's share); gradients
        accumulate. Returns the metric shares summed over micro-batches *and ranks*, and with
        ``keep_outputs`` the detached first outputs (log-probs) ``[B, T]`` of the whole batch."""
        ...

    def step(self) -> dict[str, float]:
        """Clip, apply (or skip a non-finite gradient), advance the schedule, clear gradients;
        ``{"grad_norm": ..., "lr": ...}``."""
        ...


def policy_update(batch: TrainBatch, config: MilesConfig, kernel: Kernel, *, actor: Trainee,
                  logprobs: Callable[[TrainBatch], torch.Tensor], critic: Trainee | None = None,
                  log_entropy: bool = False) -> dict[str, float]:
    """``train.updates_per_step`` optimiser updates on ``batch`` (which carries advantages).

    :param actor: the policy.
    :param logprobs: the actor's ``[B, T]`` log-probs without gradient (the proximal policy when
        several updates share the batch); never called with ``train.reuse_rollout_logprobs``,
        which takes ``batch.rollout_logprobs`` as the old policy instead.
    :param critic: the value model, trained on the same mini-batches (PPO).
    :param log_entropy: compute the per-token entropy as a metric even when ``entropy_coef`` is 0.
    :returns: metrics averaged over mini-batches (critic's under ``critic/``), the mismatch
        metrics and ``train_tokens``.
    """
    if batch.advantages is None:
        raise ValueError("train_step needs batch.advantages: run the advantage estimator (compute_advantages) first")
    if critic is not None and batch.returns is None:
        raise ValueError("train_step with a critic needs batch.returns (and batch.values): use a critic estimator (ppo)")
    params = config.algorithm
    policy_loss = kernel.policy_losses().get(config.train.policy_loss).loss
    correction = kernel.mismatch_corrections().get(params.correction).correct
    # the entropy's gradient is computed only when it enters the loss (entropy_coef != 0)
    with_entropy = log_entropy or params.entropy_coef != 0
    actor_loss = objective.micro_batch_actor_loss(params, policy_loss=policy_loss, correction=correction,
                                                  with_entropy=with_entropy)

    def critic_loss(micro: TrainBatch, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict[str, float]]:
        return objective.critic_loss(outputs[0], micro, params)

    def update(mini: TrainBatch, keep: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        shares, kept = actor.accumulate(mini, actor_loss, with_entropy=with_entropy, keep_outputs=keep)
        metrics = shares | actor.step()
        if critic is not None:
            critic_shares, _ = critic.accumulate(mini, critic_loss, with_entropy=False, keep_outputs=False)
            metrics |= {f"critic/{k}": v for k, v in (critic_shares | critic.step()).items()}
        return metrics, kept

    reuse = config.train.reuse_rollout_logprobs
    if reuse:  # exactly the trainer's log-probs under rollout.true_on_policy (the config refuses it otherwise)
        batch = replace(batch, old_logprobs=batch.rollout_logprobs)
    totals = objective.train_in_mini_batches(batch, config.train.updates_per_step, update, logprobs,
                                             old_from_rollout=reuse)
    totals["train_tokens"] = float(batch.num_tokens)
    return totals


__all__ = ["MicroLoss", "Trainee", "policy_update"]
