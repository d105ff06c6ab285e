"""LoRA in the fsdp backend, on the tiny real Llama: adapters train on a frozen base, the reference
is the base, checkpoints hold adapters and resume bitwise, and both exports load elsewhere (the
PEFT adapter with the real ``peft`` library)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from miles_contracts import LoRASpec
from miles_contracts.testing.backend import make_test_batch, plain_logprobs

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _trainable_batch(model_dir, backend=None, sign: float = 1.0, **kwargs):
    """A test batch whose every response token has advantage ``sign`` (+ old log-probs of ``backend``)."""
    batch = make_test_batch(model_dir, **kwargs)
    batch = replace(batch, advantages=sign * batch.loss_mask)
    return replace(batch, old_logprobs=backend.compute_logprobs(batch)) if backend is not None else batch


def _trained(backend, batches):
    for batch in batches:
        backend.train_step(batch)
    return backend


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def _base_weights(backend) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in backend.actor.hf.named_parameters() if ".lora_" not in n}


def test_only_adapters_train_and_the_base_stays_as_loaded(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, lora=LoRASpec(**LORA), lr=1e-2, micro_batch_tokens=20)
    trainable = [n for n, p in backend.actor.hf.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimised = {id(p) for group in backend.trained[0].optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in backend.actor.parameters() if p.requires_grad}
    # 3 targets x 2 layers, each with an A and a B
    assert len(trainable) == 3 * 2 * 2

    batch = _trainable_batch(tiny_dense, backend)
    # B starts at zero: the fresh adapter is the base model exactly
    torch.testing.assert_close(batch.old_logprobs, plain_logprobs(tiny_dense, batch), rtol=0, atol=1e-4)
    base = _base_weights(backend)
    losses = [backend.train_step(batch)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    for name, tensor in _base_weights(backend).items():
        assert torch.equal(tensor, base[name]), f"frozen {name} changed"
    sent = list(backend.named_weights())
    assert [n for n, _ in sent] == trainable
    assert any(bool(t.abs().sum() > 0) for n, t in sent if n.endswith("lora_B.weight"))


def test_the_reference_is_the_base_with_adapters_off(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, lora=LoRASpec(**LORA), use_reference=True, lr=1e-2, micro_batch_tokens=20)
    assert backend.ref is None  # no second copy of the model
    batch = _trainable_batch(tiny_dense, backend)
    for _ in range(2):
        backend.train_step(batch)
    ref = backend.compute_logprobs(batch, model="ref")
    torch.testing.assert_close(ref, plain_logprobs(tiny_dense, batch), rtol=0, atol=1e-4)
    assert not torch.allclose(backend.compute_logprobs(batch), ref, atol=1e-4)  # the actor moved, the base did not


def test_checkpoint_holds_adapters_only_and_resume_is_bitwise(tiny_dense, backend_factory, tmp_path) -> None:
    options = dict(lora=LoRASpec(**LORA, dropout=0.1), lr=1e-2, lr_schedule="cosine", warmup_steps=1, steps=4,
                   micro_batch_tokens=20)
    batches = [_trainable_batch(tiny_dense, sign=s, seed=i) for i, s in enumerate([1.0, -1.0, 1.0, -1.0])]
    straight = _trained(backend_factory(tiny_dense, **options), batches)
    want = list(straight.named_weights())
    first = _trained(backend_factory(tiny_dense, **options), batches[:2])
    first.save_checkpoint(tmp_path / "ckpt", {})
    first.close()
    stored = sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.distcp"))
    base_bytes = sum(t.numel() * 4 for t in _base_weights(straight).values())
    assert stored < base_bytes / 10, f"checkpoint holds {stored} bytes: the frozen base ({base_bytes}) was saved"

    resumed = backend_factory(tiny_dense, **options)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = list(_trained(resumed, batches[2:]).named_weights())
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"


def test_exports_load_with_peft_and_as_a_merged_checkpoint(tiny_dense, backend_factory, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    backend = backend_factory(tiny_dense, lora=LoRASpec(**LORA), lr=1e-2, micro_batch_tokens=20)
    batch = _trainable_batch(tiny_dense, backend)
    for _ in range(2):
        backend.train_step(batch)
    trained = backend.compute_logprobs(batch)
    backend.export_hf(tmp_path / "export")

    merged = plain_logprobs(tmp_path / "export", batch)
    torch.testing.assert_close(merged, trained, rtol=0, atol=1e-4)
    assert not list((tmp_path / "export").glob("adapter_*"))  # transformers must not take it for an adapter

    base = AutoModelForCausalLM.from_pretrained(str(tiny_dense), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "export" / "lora_adapter")).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, batch.tokens[:, 1:, None]).squeeze(2)
    via_peft = torch.cat([torch.zeros(batch.size, 1), logp], 1) * batch.loss_mask
    torch.testing.assert_close(via_peft, trained, rtol=0, atol=1e-4)


def test_a_target_that_matches_nothing_is_a_clear_error(tiny_dense, backend_factory) -> None:
    with pytest.raises(ValueError, match=r"target_modules: \['qkv_proj'\] match no nn.Linear.*q_proj"):
        backend_factory(tiny_dense, lora=LoRASpec(target_modules=["q_proj", "qkv_proj"]))
