"""R3 as an assertion: under ``rollout.true_on_policy`` (the tiny Qwen3-MoE with the invariant
router and experts of ``miles_engine.invariant_moe``) a forward the backend marks with
``ForwardContext.state["true_on_policy_step"]`` must route every recorded (token, MoE layer) pair
as the rollout did. The rollout's routing here is what the model reports for each row run alone
(the engine's prefill of one request); the trainer's forward is the padded batch of both rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from miles.context import context_for
from miles_contracts import ForwardContext, TrainBatch
from miles_r3 import plugin as r3
from miles_r3.config import R3Section
from miles_r3.experts import ROUTED_EXPERTS

LENGTHS = [9, 6]
WIDTH = 9
NUM_EXPERTS = 4


@pytest.fixture(scope="module")
def model(tiny_moe: Path) -> Any:
    from miles_engine import invariant
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32, attn_implementation=invariant.register())
    invariant.install_linears(hf)
    return hf.eval()


@pytest.fixture
def settings() -> Iterator[Any]:
    saved = r3.STATE._settings, r3.STATE.on_policy_check

    def use(*, replay: bool, check: str = "error") -> None:
        r3.STATE.settings = R3Section(enabled=True, replay=replay)
        r3.STATE.on_policy_check = check
        r3.STATE.stats.flush()

    yield use
    r3.STATE._settings, r3.STATE.on_policy_check = saved


def _rollout(model: Any) -> TrainBatch:
    """Two rows (padded to ``WIDTH``) with the routing each row got alone, as an engine records it
    (every position but a row's last; ``NUM_EXPERTS`` = no record)."""
    from miles_engine.routing import RoutingCapture

    generator = torch.Generator().manual_seed(0)
    tokens = torch.zeros(len(LENGTHS), WIDTH, dtype=torch.long)
    experts = torch.full((len(LENGTHS), WIDTH, 2, 2), NUM_EXPERTS, dtype=torch.uint8)
    capture = RoutingCapture(model)
    try:
        for row, n in enumerate(LENGTHS):
            tokens[row, :n] = torch.randint(3, 1000, (n,), generator=generator)
            with torch.no_grad():
                model(input_ids=tokens[row : row + 1, :n])
            experts[row, : n - 1] = capture.take()[: n - 1].to(torch.uint8)
    finally:
        capture.close()
    mask = (torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    zeros = torch.zeros(len(LENGTHS), WIDTH)
    return TrainBatch(tokens=tokens, attention_mask=mask, loss_mask=zeros, rollout_logprobs=zeros,
                      rewards=torch.zeros(len(LENGTHS)), group_ids=torch.zeros(len(LENGTHS), dtype=torch.long),
                      rollout_ids=torch.tensor([10, 11]), extras={ROUTED_EXPERTS.name: experts})


def _forward(model: Any, batch: TrainBatch, *, step: int | None = 3) -> torch.Tensor:
    from miles_model_qwen3.bridge import Qwen3Bridge

    flat = torch.arange(batch.tokens.numel())
    positions = torch.where(batch.attention_mask.reshape(-1) > 0, flat, -1)
    state: dict[str, Any] = {"token_positions": lambda: positions}
    if step is not None:
        state["true_on_policy_step"] = step
    ctx = ForwardContext(phase="train", model=model, batch=batch, backend="fsdp", bridge=Qwen3Bridge(), state=state)
    with torch.no_grad():
        return context_for().kernel.run_forward(
            ctx, lambda: model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits)


def test_the_trainer_routes_every_pair_as_the_rollout_did(model: Any, settings: Any) -> None:
    settings(replay=False)
    batch = _rollout(model)
    _forward(model, batch)
    stats = r3.STATE.stats.flush()
    recorded = sum(n - 1 for n in LENGTHS)
    assert stats["r3/train/true_on_policy_checked_pairs"] == recorded * 2  # two MoE layers
    assert stats["r3/train/true_on_policy_mismatched_pairs"] == 0.0
    assert stats["r3/train/routing_agreement"] == 1.0


def test_replaying_an_exact_routing_changes_no_bit(model: Any, settings: Any) -> None:
    """Replay keeps the router's own weights where the recorded experts are its own choice, so the
    replayed forward equals the unreplayed one (a recomputed gate would differ in the last bits)."""
    batch = _rollout(model)
    settings(replay=False)
    own = _forward(model, batch)
    settings(replay=True)
    assert torch.equal(_forward(model, batch), own)


def test_a_routing_mismatch_fails_the_step_by_name_or_is_counted(model: Any, settings: Any) -> None:
    batch = _rollout(model)
    experts = batch.extras[ROUTED_EXPERTS.name]
    recorded = experts[1, 2, 1].tolist()
    experts[1, 2, 1] = torch.tensor([e for e in range(NUM_EXPERTS) if e not in recorded][:2], dtype=torch.uint8)
    settings(replay=False)
    with pytest.raises(r3.RoutingMismatch) as raised:
        _forward(model, batch)
    message = str(raised.value)
    assert (f"step 3, sample 11 (batch row 1), token 2 of the sequence (token id {int(batch.tokens[1, 2])}), "
            f"MoE layer 1 (router model.layers.1.mlp.gate)") in message, message
    assert f"the rollout to {experts[1, 2, 1].tolist()}" in message and "1 of 26 (token, MoE layer) pairs" in message
    r3.STATE.stats.flush()
    settings(replay=False, check="metric")
    _forward(model, batch)
    stats = r3.STATE.stats.flush()
    assert stats["r3/train/true_on_policy_mismatched_pairs"] == 1.0
    # a forward the backend does not mark (weights moved since the rollout) is only measured
    settings(replay=False)
    _forward(model, batch, step=None)
    assert "r3/train/true_on_policy_checked_pairs" not in r3.STATE.stats.flush()
