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
    names (through the bridge, like the weights; with LoRA the adapters' PEFT names), ``{}`` on other ranks. Collective. Build the
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
    gather = backend.trained  # every weight, or (LoRA) the adapters
    # the same shards, holding their gradients instead of their weights
    shards = [replace(s, param=s.param.main_grad.to(s.param.dtype)) for s in gather.shards.values()]
    grads = WeightGather(shards, gather.order, gather.bridge, gather.hf_config, gather.vocab_size)
    try:
        return {name: g.clone() for name, g in grads.gather(torch.float32, backend.device)}  # before zeroing
    finally:
        for chunk in backend.actor.wrapped:
            chunk.zero_grad_buffer()


def _trainable(batch: Any, logprobs: Any) -> Any:
    """``batch`` as a training batch: advantage 1 on every completion token, scored by ``logprobs``."""
    import torch

    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(batch.loss_mask), torch.zeros_like(batch.loss_mask))
    return replace(batch, advantages=advantages, old_logprobs=logprobs, rollout_logprobs=logprobs)


def lora_train_settings() -> dict[str, Any]:
    """The ``train`` fields of the LoRA comparisons: adapters on both kinds of parallel linear."""
    from miles_contracts import LoRASpec

    spec = LoRASpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    return {"lora": spec, "lr": 1e-2}


def lora_steps(backend: Any, batch: Any) -> dict[str, Any]:
    """What a LoRA layout comparison looks at (the same calls on every layout): a step (``B`` starts
    at zero, so the first gradients reach ``B`` only), then log-probs, the adapter gradients of
    the next batch, a second step's metrics and the adapters it left (rank 0). Collective."""
    first = _trainable(batch, backend.compute_logprobs(batch))
    result: dict[str, Any] = {"first": backend.train_step(first)}
    result["logprobs"] = backend.compute_logprobs(batch)
    second = _trainable(batch, result["logprobs"])
    result["gradients"] = hf_gradients(backend, second)
    result["metrics"] = backend.train_step(second)
    result["adapters"] = {name: t.clone() for name, t in backend.named_weights()}
    return result
