"""The plugin's switches: nothing happens until ``r3.enabled``, ``plugins.disable: [r3]`` turns it
off without touching the section, a dense model is left alone, evaluation carries no capture, and a
sample dropped for missing routing is counted."""

from __future__ import annotations

from pathlib import Path

import torch
from miles.config import build_config
from miles.context import context_for
from miles.loop.rollout import RolloutManager, rollout_metrics
from miles_contracts import ExitReason, ForwardContext, Process, RunContext, Sample, Status, TrainBatch
from miles_r3.experts import ROUTED_EXPERTS


def driver(data: dict) -> RunContext:
    """The driver's context of a run of ``data`` (its kernel loaded for the run's plugin selection)."""
    return context_for(build_config(data), Process.driver())


def captures_of(data: dict) -> list[str]:
    ctx = driver(data)
    return [c.spec.name for c in ctx.kernel.engine_captures(ctx)]


def test_routing_is_captured_only_when_enabled_and_the_model_is_moe(tiny_moe: Path, tiny_dense: Path) -> None:
    assert captures_of({"model": {"name": str(tiny_moe)}}) == []  # installed is not enabled
    assert captures_of({"model": {"name": str(tiny_moe)}, "r3": {"enabled": True}}) == [ROUTED_EXPERTS.name]
    assert captures_of({"model": {"name": str(tiny_dense)}, "r3": {"enabled": True}}) == []  # dense: nothing to record
    # the off switch of the issue: the section may stay
    assert captures_of({"model": {"name": str(tiny_moe)}, "r3": {"enabled": True}, "plugins": {"disable": ["r3"]}}) == []


def test_training_rollouts_carry_the_capture_and_evaluation_does_not(tiny_moe: Path) -> None:
    ctx = driver({"model": {"name": str(tiny_moe)}, "r3": {"enabled": True}})
    manager = RolloutManager(ctx, data=None, engine=None, tokenizer=None)  # type: ignore[arg-type]
    assert [c.spec.name for c in manager.context().captures] == [ROUTED_EXPERTS.name]
    assert list(manager.context(evaluation=True).captures) == []


def test_samples_dropped_for_missing_routing_are_counted() -> None:
    kept = Sample(tokens=[1, 2], response_length=1, loss_mask=[1], reward=1.0, status=Status.COMPLETED)
    dropped = Sample(tokens=[1, 2], response_length=1, loss_mask=[1]).finish(
        Status.FAILED, ExitReason.MISSING_CAPTURE, "r3.routed_experts: engine call 0 returned no payload")
    metrics = rollout_metrics([kept, dropped], [[kept]], drops={}, generated_groups=1, surplus=0, seconds=1.0)  # type: ignore[arg-type]
    assert metrics["rollout/exit_missing_capture"] == 1.0 and not dropped.trainable


def test_a_dense_model_forward_is_untouched(tiny_dense: Path) -> None:
    """Even a batch that carries routed experts leaves a dense model's forward as it is."""
    from miles_model_llama.bridge import LlamaBridge
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32).eval()
    tokens = torch.tensor([[1, 2, 3, 4]])
    zeros = torch.zeros(1, 4)
    batch = TrainBatch(tokens=tokens, attention_mask=torch.ones(1, 4, dtype=torch.long), loss_mask=zeros,
                       rollout_logprobs=zeros, rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long),
                       rollout_ids=torch.zeros(1, dtype=torch.long),
                       extras={ROUTED_EXPERTS.name: torch.zeros(1, 4, 2, 2, dtype=torch.uint8)})
    ctx = ForwardContext(phase="train", model=model, batch=batch, backend="fsdp", bridge=LlamaBridge(),
                         state={"token_positions": lambda: torch.arange(4)})
    with torch.no_grad():
        plain = model(tokens).logits
        wrapped = context_for().kernel.run_forward(ctx, lambda: model(tokens).logits)
    assert torch.equal(plain, wrapped)
