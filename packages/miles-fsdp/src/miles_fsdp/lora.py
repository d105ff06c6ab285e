"""LoRA in the fsdp backend: adapters on a frozen base, and the files they leave as.

The adapter module is the engine's (:mod:`miles_engine.lora`), so trainer and engine compute the
same ``W x + (alpha / r) B A x`` under the same names. Here:

- :func:`attach_adapters` wraps the target linears before sharding; adapters are fp32 (master
  weights, like every trained weight) and the frozen base is cast to the compute dtype (bf16 on
  CUDA: half the bytes, and there is no optimiser state or gradient to keep for it).
- :func:`train_only_adapters` leaves ``requires_grad`` on the adapters alone, so only they get
  gradients, are reduce-scattered and reach the optimiser (:func:`miles_fsdp.optim.build_optimizer`
  takes ``requires_grad`` parameters only).
- The KL reference is the actor with its adapters switched off (``adapters_disabled``): the base,
  without a second copy.
- :func:`adapter_state` / :func:`merged_weights`: the adapter tensors (what weight syncs and
  checkpoints carry) and the merged export (the PEFT files: :func:`miles_engine.lora.write_peft_adapter`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from miles_engine.lora import LoRALinear, attach_lora, is_adapter_tensor, lora_layers
from torch import nn

if TYPE_CHECKING:
    from miles_contracts.lora import LoRASpec

    from miles_fsdp.models import Precision



def attach_adapters(hf: nn.Module, spec: LoRASpec, precision: Precision) -> list[str]:
    """Wrap ``spec.target_modules`` with fp32 adapters; cast the base to the compute dtype when it
    differs (CUDA). Returns the wrapped module names."""
    wrapped = attach_lora(hf, spec, adapter_dtype=precision.param)
    if precision.mixed:
        adapters = {id(p) for layer in lora_layers(hf) for p in (layer.lora_A.weight, layer.lora_B.weight)}
        for param in hf.parameters():
            if id(param) not in adapters and param.is_floating_point():
                param.data = param.data.to(precision.compute)
    return wrapped


def train_only_adapters(module: nn.Module) -> bool:
    """If ``module`` holds adapters, freeze everything else; returns whether it holds any."""
    layers = lora_layers(module)
    if not layers:
        return False
    module.requires_grad_(False)
    for layer in layers:
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
    return True


def adapter_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters() if is_adapter_tensor(name)]


def adapter_state(hf: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every adapter weight of ``hf``, in module order (collective under
    FSDP: every rank must iterate to the end)."""
    from torch.distributed.tensor import DTensor

    for name, param in hf.named_parameters():
        if not is_adapter_tensor(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        full = full.detach()
        yield name, (full.to(dtype) if dtype is not None else full).contiguous()


def merged_weights(named: Iterator[tuple[str, torch.Tensor]], wrapped: set[str],
                   scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Full named weights with each adapter folded in (``W + scaling * B A``, computed in fp32) and
    the adapter tensors dropped: a plain checkpoint of the fine-tuned model. ``wrapped``: the base
    weight names that carry adapters (:func:`wrapped_weight_names`). A layer's three tensors may
    come in any order; each merged weight is yielded once all three arrived (the gathers yield
    them layer by layer, so at most one layer is held)."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if name in wrapped:
            owner, part = name, "base"
        elif is_adapter_tensor(name):
            module, _, part = name.removesuffix(".weight").rpartition(".")  # "...q_proj", "lora_A"
            owner = f"{module}.weight"
        else:
            yield name, tensor
            continue
        parts = held.setdefault(owner, {})
        parts[part] = tensor
        if len(parts) == 3:
            del held[owner]
            merged = parts["base"].float() + scaling * (parts["lora_B"].float() @ parts["lora_A"].float())
            yield owner, merged.to(parts["base"].dtype)
    if held:
        raise ValueError(f"base or adapter tensors missing for {sorted(held)[:3]}: cannot merge them")


def wrapped_weight_names(hf: nn.Module) -> set[str]:
    """``<path>.weight`` of every wrapped linear of ``hf`` (their base weight names)."""
    return {f"{path}.weight" for path, m in hf.named_modules() if isinstance(m, LoRALinear)}
