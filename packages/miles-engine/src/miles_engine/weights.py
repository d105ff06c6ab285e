"""The served model's weights by name: load updates, checksum, fill with noise.

Names are the keys of the transformers model's ``state_dict()`` (``model.layers.0.mlp.gate.weight``,
``lm_head.weight`` ...), which is what a trainer holding the same transformers model sends. Tied
weights answer to both names. Every update is checked whole (names, shapes) before the first
tensor is copied, so a bad request changes nothing. All methods run on the scheduler thread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


class WeightUpdateError(ValueError):
    """An update names tensors the model lacks, or gives the wrong shape; nothing was changed."""


def parse_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use torch names such as 'bfloat16' or 'float32'")
    return dtype


class WeightStore:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tensors: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))

    def check(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        unknown, wrong = [], []
        for name, shape in shapes:
            target = self.tensors.get(name)
            if target is None:
                unknown.append(name)
            elif tuple(target.shape) != tuple(shape):
                wrong.append(f"{name}: sent {list(shape)}, model has {list(target.shape)}")
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown tensor name(s) {_preview(unknown)} "
                            f"(the engine expects the names of the transformers model's state_dict, e.g. {next(iter(self.tensors))!r})")
        if wrong:
            problems.append(f"{len(wrong)} shape mismatch(es): {_preview(wrong)}")
        if problems:
            raise WeightUpdateError("weight update rejected, nothing was loaded: " + "; ".join(problems))

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the model (cast to the model's dtype and device); returns how
        many. Call :meth:`check` first."""
        import torch

        count = 0
        with torch.no_grad():
            for name, tensor in named:
                self.tensors[name].data.copy_(tensor, non_blocking=False)
                count += 1
        return count

    def load_checked(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self.check((n, tuple(t.shape)) for n, t in named)
        return self.load(named)

    def load_from_disk(self, folder: str) -> int:
        """Load every tensor of the safetensors files in ``folder``. Files in the model's own
        naming load directly; a Hugging Face checkpoint in another layout (e.g. per-expert MoE
        weights) goes through transformers' loader first."""
        from safetensors import safe_open

        files = _safetensors_files(Path(folder))
        names: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    names[key] = tuple(f.get_slice(key).get_shape())
        if all(name in self.tensors for name in names):
            self.check(names.items())
            count = 0
            for file in files:
                with safe_open(file, framework="pt") as f:
                    count += self.load((key, f.get_tensor(key)) for key in f.keys())  # noqa: SIM118
            return count
        return self._load_checkpoint(folder)

    def _load_checkpoint(self, folder: str) -> int:
        from transformers import AutoModelForCausalLM

        dtype = next(iter(self.tensors.values())).dtype
        try:
            other = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu")
        except Exception as exc:
            raise WeightUpdateError(f"cannot load {folder} as a checkpoint of this model: {exc}") from exc
        state = other.state_dict()
        self.check((n, tuple(t.shape)) for n, t in state.items())
        return self.load(state.items())

    def checksums(self) -> dict[str, str]:
        """SHA-256 of each tensor's raw bytes (contiguous, row-major, own dtype), by name."""
        import torch

        out = {}
        for name, tensor in self.tensors.items():
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
            out[name] = hashlib.sha256(raw.numpy()).hexdigest()
        return out

    def fill_noise(self, seed: int) -> int:
        """Overwrite every tensor with N(0, 0.02) noise from ``seed`` (same bits on any device)."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        seen: set[int] = set()
        with torch.no_grad():
            for tensor in self.tensors.values():
                if tensor.data_ptr() in seen or not tensor.is_floating_point():
                    continue
                seen.add(tensor.data_ptr())
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 0.02
                tensor.data.copy_(noise)
        return len(seen)


def _safetensors_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise WeightUpdateError(f"model_path {str(folder)!r} is not a folder on the engine's host")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightUpdateError(f"the index in {folder} names missing shards: {_preview(missing)}")
    return [str(f) for f in files]


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
