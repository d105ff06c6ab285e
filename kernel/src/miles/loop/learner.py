"""One training step on a batch of scored samples: log-prob passes, advantages, optimiser step.

Runs in the driver; the passes and the optimiser step run in the trainer ranks behind the
:class:`~miles_contracts.TrainBackend`-shaped handle it is given. The math lives in the
registered advantage estimator (plus the terms every estimator gets, :mod:`miles.advantages`) and
the train backend (which applies the registered policy loss and mismatch correction).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal, Protocol

from miles_contracts import Sample, TrainBatch

from miles.advantages import estimate_advantages
from miles.config import MilesConfig
from miles.kernel import Kernel

if TYPE_CHECKING:
    import torch


class Scorer(Protocol):
    """The part of a train backend a learner drives: a :class:`~miles_contracts.TrainBackend` or
    the :class:`~miles.trainer.group.TrainerGroup` in front of the ranks that hold one."""

    def compute_logprobs(self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor") -> torch.Tensor: ...

    def compute_values(self, batch: TrainBatch) -> torch.Tensor: ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...


class Learner:
    def __init__(self, config: MilesConfig, kernel: Kernel, backend: Scorer, pad_token_id: int) -> None:
        self.config = config
        self.backend = backend
        self.pad_token_id = pad_token_id
        self.advantage = kernel.advantages().get(config.algorithm.advantage)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Train on ``samples`` (trainable ones only); returns namespaced metrics."""
        timings: dict[str, float] = {}
        start = time.perf_counter()
        batch = TrainBatch.from_samples(samples, self.pad_token_id)
        # The proximal policy: with one optimiser step per RL step it equals the current policy,
        # so the backend takes it from the training forward (ratio exactly 1) and we save a pass.
        # With train.reuse_rollout_logprobs it is the rollout's own log-probs (policy_update puts
        # them in place in the trainer ranks), so no pass runs and time/old_logprobs is absent.
        if self.config.train.updates_per_step > 1 and not self.config.train.reuse_rollout_logprobs:
            batch.old_logprobs = self.backend.compute_logprobs(batch, model="actor")
            timings["time/old_logprobs"] = time.perf_counter() - start
        if self.config.train.use_reference:
            batch.ref_logprobs = self.backend.compute_logprobs(batch, model="ref")
        if self.config.algorithm.opd_coef > 0:
            batch.teacher_logprobs = self.backend.compute_logprobs(batch, model="teacher")
        if self.advantage.needs_critic:
            batch.values = self.backend.compute_values(batch)
        timings["time/logprobs"] = time.perf_counter() - start

        result = estimate_advantages(batch, self.config.algorithm, self.advantage)
        batch.advantages, batch.returns = result.advantages, result.returns

        start = time.perf_counter()
        # the backend's own names get ``train/``; plugins' (``miles_train_step_end``) keep their namespace
        metrics = {k if "/" in k else f"train/{k}": float(v) for k, v in self.backend.train_step(batch).items()}
        timings["time/optimizer"] = time.perf_counter() - start
        metrics.update({f"advantage/{k}": float(v) for k, v in result.metrics.items()})
        metrics["train/samples"] = float(batch.size)
        return {**metrics, **timings}
