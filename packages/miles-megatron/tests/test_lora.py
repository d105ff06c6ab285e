"""LoRA in the megatron backend, one process on the tiny real Llama: the run starts at the base,
only the adapters train, the reference stays the base, checkpoints hold the adapters and resume
bit-exact, the adapters carry the fsdp backend's (PEFT's) names and shapes, and both exports
(merged safetensors, PEFT adapter loaded by ``peft``) give the trained actor's log-probs.
TP=2 against one process: ``test_multirank.py::test_lora_at_tp2_matches_one_process``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from miles_contracts import LoRASpec
from miles_contracts.testing.backend import make_test_batch, plain_logprobs

LORA = LoRASpec(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])


def _train(backend, batch, steps: int) -> None:
    for _ in range(steps):
        logprobs = backend.compute_logprobs(batch)
        advantages = torch.where(batch.loss_mask > 0, torch.ones_like(logprobs), torch.zeros_like(logprobs))
        backend.train_step(replace(batch, advantages=advantages, old_logprobs=logprobs, rollout_logprobs=logprobs))


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _hf_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits.float()
    picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0)) * batch.loss_mask


@pytest.mark.slow
def test_lora_trains_adapters_on_the_base_and_resumes_exactly(tiny_dense, backend_factory, tmp_path) -> None:
    batch = make_test_batch(tiny_dense)
    backend = backend_factory(tiny_dense, lora=LORA, lr=1e-2, use_reference=True)
    base = dict(backend.gather.gather(torch.float32, backend.device))
    torch.testing.assert_close(backend.compute_logprobs(batch), plain_logprobs(tiny_dense, batch), rtol=0, atol=1e-5)
    assert backend.ref is None  # no second model: the reference is the actor with its adapters off
    trainable = {n: p for chunk in backend.actor.chunks for n, p in chunk.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_linear_" in n for n in trainable)  # gradients (and their reduction): adapters only
    optimized = [p for group in backend.actor.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == sum(p.numel() for p in trainable.values())
    _train(backend, batch, 2)
    backend.save_checkpoint(tmp_path / "ckpt", {"step": 2})
    _train(backend, batch, 2)
    straight = dict(backend.named_weights())

    trained = backend.compute_logprobs(batch)
    assert (trained - plain_logprobs(tiny_dense, batch)).abs().max() > 1e-3  # the adapters moved the policy
    torch.testing.assert_close(backend.compute_logprobs(batch, model="ref"), plain_logprobs(tiny_dense, batch),
                               rtol=0, atol=1e-5)
    for name, tensor in backend.gather.gather(torch.float32, backend.device):
        assert torch.equal(tensor, base[name]), name  # the base is frozen

    # a checkpoint holds the adapters (and their Adam moments), not the base
    model_bytes = sum(f.stat().st_size for f in Path(tiny_dense).glob("*.safetensors"))
    assert _folder_bytes(tmp_path / "ckpt" / "megatron") < model_bytes / 10
    resumed = backend_factory(tiny_dense, lora=LORA, lr=1e-2, use_reference=True)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"step": 2}
    _train(resumed, batch, 2)
    again = dict(resumed.named_weights())
    assert again.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.equal(again[name], tensor), name  # 2 + save + load + 2 steps == 4 steps, bitwise


@pytest.mark.slow
def test_lora_adapters_have_fsdp_names_and_both_exports_load(tiny_dense, backend_factory, tmp_path) -> None:
    from miles_engine.lora import attach_lora
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = make_test_batch(tiny_dense)
    backend = backend_factory(tiny_dense, lora=LORA.model_copy(update={"dropout": 0.0}), lr=1e-2)
    _train(backend, batch, 2)
    adapters = dict(backend.named_weights())
    # the names and shapes the fsdp backend (miles_engine.lora on the HF model) gives the same adapters
    hf = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32)
    attach_lora(hf, LORA)
    want = {n: tuple(p.shape) for n, p in hf.named_parameters() if ".lora_" in n}
    assert {n: tuple(t.shape) for n, t in adapters.items()} == want

    actor = backend.compute_logprobs(batch)
    backend.export_hf(tmp_path / "export")
    torch.testing.assert_close(plain_logprobs(tmp_path / "export", batch), actor, rtol=0, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_dense, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "export" / "lora_adapter").eval()
    torch.testing.assert_close(_hf_logprobs(peft_model, batch), actor, rtol=0, atol=1e-4)


def test_lora_refuses_targets_the_backend_cannot_place(tiny_dense, backend_factory) -> None:
    with pytest.raises(ValueError, match=r"train.lora.target_modules: \['lm_head'\]"):
        backend_factory(tiny_dense, lora=LoRASpec(target_modules=["q_proj", "lm_head"]))


def test_lora_refuses_transformer_engine_layers(tiny_dense, backend_factory) -> None:
    """Transformer Engine's linear_qkv / linear_fc1 apply the layer norm inside: an adapter on them
    would see the input before the norm."""
    with pytest.raises(ValueError, match="train.lora .* megatron.transformer_impl: local or auto"):
        backend_factory(tiny_dense, lora=LoRASpec(rank=4), megatron={"transformer_impl": "transformer_engine"})
