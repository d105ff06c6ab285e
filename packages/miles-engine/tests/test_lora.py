"""Unmerged LoRA adapters (``miles_engine.lora``) on the tiny real Llama: a fresh adapter is the
base, a trained one equals the merged weight, switching adapters off gives the base back, the CPU
engine's packed linears keep the adapter term, and the config refuses bad settings naming the key."""

from __future__ import annotations

import pytest
import torch
from miles_contracts import LoRASpec
from miles_engine import cpu_linear
from miles_engine.lora import LoRALinear, adapters_disabled, attach_lora
from pydantic import ValidationError

SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _randomise_adapters(model) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.05)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapters_unmerged_equal_merged_and_switch_off(dense_path) -> None:
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    base = _model(dense_path)
    want_base = _logits(base, ids)
    wrapped = attach_lora(base, SPEC)
    assert len(wrapped) == 2 * 2 and all(n.endswith(("q_proj", "down_proj")) for n in wrapped)
    names = [n for n in base.state_dict() if ".lora_" in n]
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names and "model.layers.0.self_attn.q_proj.weight" in base.state_dict()
    torch.testing.assert_close(_logits(base, ids), want_base, rtol=0, atol=0)  # B = 0: the base exactly

    _randomise_adapters(base)
    merged = _model(dense_path)
    with torch.no_grad():
        for path, layer in base.named_modules():
            if isinstance(layer, LoRALinear):
                merged.get_submodule(path).weight.copy_(layer.merged_weight())
    adapted = _logits(base, ids)
    assert not torch.allclose(adapted, want_base, atol=1e-3)
    torch.testing.assert_close(adapted, _logits(merged, ids), rtol=0, atol=1e-5)
    with adapters_disabled(base):
        torch.testing.assert_close(_logits(base, ids), want_base, rtol=0, atol=0)
    torch.testing.assert_close(_logits(base, ids), adapted, rtol=0, atol=0)  # back on after the block


@pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN packed linears are not available in this torch")
def test_packed_cpu_linears_keep_the_adapter_term(dense_path) -> None:
    ids = torch.arange(1, 17)[None]  # >= MIN_ROWS rows: the packed path runs
    model = _model(dense_path)
    attach_lora(model, SPEC)
    _randomise_adapters(model)
    want = _logits(model, ids)
    cpu_linear.PackedLinears(model)
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=1e-4)


def test_a_target_matching_nothing_names_the_linear_layers(dense_path) -> None:
    with pytest.raises(ValueError, match=r"\['wq'\] match no nn.Linear.*'q_proj'"):
        attach_lora(_model(dense_path), LoRASpec(target_modules=["wq"]))


@pytest.mark.parametrize(("settings", "key"), [
    ({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"target_modules": []}, "target_modules"), ({"target_modules": ["layers.0.q_proj"]}, "target_modules"),
    ({"target_modules": ["q_proj", "q_proj"]}, "target_modules"), ({"rnak": 8}, "rnak"),
])
def test_bad_settings_are_refused_naming_the_key(settings: dict, key: str) -> None:
    with pytest.raises(ValidationError) as caught:
        LoRASpec(**settings)
    assert [e["loc"][0] for e in caught.value.errors()] == [key]
