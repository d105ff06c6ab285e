"""Low-rank adapters on a model's linear layers, unmerged: ``W x + b + (alpha / r) * B A x``.

One module serves the embedded engine and the trainers that reuse it (miles-fsdp): the rollout
and the training forward then run the same maths on the same parameter names, and an adapter
synced from the trainer lands in the engine under the name it left with.

Names follow PEFT's, without its ``base_model.model.`` prefix: a wrapped ``...q_proj`` keeps its
``weight`` and ``bias`` under their own names (so checkpoints, full-weight updates and checksums
of the base are unchanged) and gains ``...q_proj.lora_A.weight [r, in]`` and
``...q_proj.lora_B.weight [out, r]``.

The adapter stays unmerged (never folded into ``W``): the base is shared, an update is the small
adapter tensors only, and the base can be scored with the adapters switched off
(:func:`adapters_disabled`), which is how a trainer gets its KL reference without a second copy.
:func:`write_peft_adapter` writes adapter tensors as a PEFT folder (both train backends export with it).
The wrapper is not an ``nn.Linear`` on purpose: the CPU engine's packed linears replace the
forward of every ``nn.Linear`` they find, which would drop the adapter term (the adapter's own
two ``nn.Linear`` are packed as usual).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from miles_contracts.lora import LoRASpec

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_PREFIX = "base_model.model."  # PEFT stores adapter keys under the wrapped model's path
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is an adapter tensor (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return name.endswith(ADAPTER_SUFFIXES)


class LoRALinear(nn.Module):
    """A linear layer ``y = x W^T + b`` plus a low-rank update ``scaling * B(A(dropout(x)))``.

    ``weight`` / ``bias`` are the wrapped layer's own parameters (not copies). ``A`` is Kaiming
    uniform (as ``nn.Linear`` and PEFT initialise it) and ``B`` zero, so a fresh adapter changes
    nothing.
    """

    def __init__(self, base: nn.Linear, spec: LoRASpec, *, adapter_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dtype = adapter_dtype or base.weight.dtype
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout: nn.Module = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.scaling = spec.scaling
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        # [.., in] -> [.., r] -> [.., out]; the adapter runs in the dtype its weights are computed in
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + (update * self.scaling).to(out.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + scaling * B A`` in fp32 (full tensors: call on unsharded modules)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return self.weight.float() + self.scaling * delta

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.lora_A.out_features}, " \
               f"scaling={self.scaling}"


def attach_lora(model: nn.Module, spec: LoRASpec, *, adapter_dtype: torch.dtype | None = None) -> list[str]:
    """Wrap every ``nn.Linear`` whose leaf name is in ``spec.target_modules`` (in place); returns
    the wrapped modules' names. Raises ``ValueError`` naming a target that matches no linear layer,
    with the linear leaf names the model has."""
    found: dict[str, list[str]] = {name: [] for name in spec.target_modules}
    linear_leaves: set[str] = set()
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        leaf = path.rpartition(".")[2]
        linear_leaves.add(leaf)
        if leaf in found:
            found[leaf].append(path)
    missing = [name for name, paths in found.items() if not paths]
    if missing:
        raise ValueError(f"train.lora.target_modules: {missing} match no nn.Linear of {type(model).__name__}; "
                         f"its linear layers are named {sorted(linear_leaves)}")
    wrapped = []
    for paths in found.values():
        for path in paths:
            parent_path, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf), spec, adapter_dtype=adapter_dtype))
            wrapped.append(path)
    return wrapped


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, ``model`` computes its base (every adapter off); restored on exit, error or not."""
    with switched_off(lora_layers(model)):
        yield


class Switchable(Protocol):
    """An adapter that can be switched off (:class:`LoRALinear`, and the megatron backend's)."""

    adapter_enabled: bool


@contextlib.contextmanager
def switched_off(layers: Sequence[Switchable]) -> Iterator[None]:
    """Inside, every one of ``layers`` computes without its adapter; restored on exit, error or not."""
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, previous, strict=True):
            layer.adapter_enabled = enabled


def peft_config(spec: LoRASpec, base_model_name: str | None) -> dict[str, object]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter with these settings."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def write_peft_adapter(path: Path, tensors: dict[str, torch.Tensor], spec: LoRASpec, base_model_name: str | None) -> None:
    """A PEFT adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``
    (``PeftModel.from_pretrained(base, path)`` loads it)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + name: t.cpu().contiguous() for name, t in tensors.items()}, str(path / PEFT_WEIGHTS),
              metadata={"format": "pt"})
    (path / PEFT_CONFIG).write_text(json.dumps(peft_config(spec, base_model_name), indent=2) + "\n")
