"""Helpers for tests of the megatron backend (and of code that drives it): a CPU config of a tiny
model, and the gradients of one batch by HF parameter name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any


def config_for(model_dir: Path | str, *, megatron: dict[str, Any] | None = None, algorithm: dict[str, Any] | None = None,
               temperature: float = 1.0, steps: int = 8, **train: Any) -> Any:
    """A CPU ``MilesConfig`` for ``model_dir`` with the ``megatron`` section ``megatron``."""
    from miles.config import MilesConfig
    from miles.sections import AlgorithmSection, ModelSection, RolloutSection, RunSection, TrainSection

    from miles_megatron.config import MegatronSection

    train.setdefault("lr", 1e-3)
    train.setdefault("micro_batch_tokens", 20)
    return MilesConfig(
        model=ModelSection(name=str(model_dir), device="cpu"), run=RunSection(steps=steps),
        rollout=RolloutSection(temperature=temperature), train=TrainSection(**train),
        algorithm=AlgorithmSection(**(algorithm or {})), extra={"megatron": MegatronSection(**(megatron or {}))},
    )


def hf_gradients(backend: Any, batch: Any) -> dict[str, Any]:
    """Accumulate one batch's actor gradient (no optimizer step) and return it on rank 0 with HF
    names (through the bridge, like the weights), ``{}`` on other ranks. Collective. Build the
    backend with ``distributed_optimizer: False``: the distributed optimizer keeps each rank's
    part of the reduced gradient only."""
    import torch
    from miles_algorithms import objective

    from miles_megatron.cpu_shim import cpu_megatron
    from miles_megatron.weights import WeightGather

    params = backend.config.algorithm
    policy_loss = backend.kernel.policy_losses().get("ppo_clip").loss
    correction = backend.kernel.mismatch_corrections().get("none").correct

    def loss_fn(micro, outputs):
        return objective.actor_loss(outputs[0], micro, params, policy_loss=policy_loss, correction=correction)

    with cpu_megatron():
        # the schedule finishes with finalize_model_grads: main_grad then holds reduced gradients
        backend._runner(backend.actor).accumulate("train", objective.prepare_batch(batch), loss_fn)
    gather = backend.gather
    # the same shards, holding their gradients instead of their weights
    shards = [replace(s, param=s.param.main_grad.to(s.param.dtype)) for s in gather.shards.values()]
    grads = WeightGather(shards, gather.order, gather.bridge, gather.hf_config, gather.vocab_size)
    try:
        return {name: g.clone() for name, g in grads.gather(torch.float32, backend.device)}  # before zeroing
    finally:
        for chunk in backend.actor.wrapped:
            chunk.zero_grad_buffer()
