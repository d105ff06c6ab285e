"""Faster fp32 linear layers on CPU: oneDNN with weights pre-packed once.

On this project's CPUs (AVX2, no AVX-512) MKL's sgemm reaches ~15-25 GFLOP/s on the decode
shapes (``[batch, hidden] x [hidden, out]`` with a batch of 8-64), while oneDNN with a weight
reordered once into its blocked layout reaches ~40-60 (measured in docs/benchmarks/engine.md).
Every ``nn.Linear`` of the model (the tied ``lm_head`` included) keeps its weight as is (weight
updates, checksums and the small-batch path use it) and gains a packed copy used for inputs of at
least :data:`MIN_ROWS` rows; single-row GEMVs are memory bound and stay on the default path.
After any in-place weight change, call :meth:`PackedLinears.repack` (with the changed storages, so
that a bucket of a weight sync repacks only its own layers).

The cost is a second copy of the linear weights in memory.

Batch invariance (``batch_invariant=True``, deterministic engines): MKL's sgemm gives a row
different bits depending on how many rows share the call (1, 2-3 and 4+ rows took three different
paths here), while the packed oneDNN path gave the same bits for every row count from 2 to 300
(SmolLM2's and the tiny test model's shapes, 1 and 2 threads, this project's AVX2 CPUs; a single
row on a K=1536 input differed). So every input goes through the packed path, and inputs of fewer
than :data:`MIN_ROWS` rows are zero-padded to it. That is measured, not promised by oneDNN: other
CPUs (AVX-512, AMX) may pick kernels per row count differently.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

MIN_ROWS = 4
_PACK_HINT = 32  # the batch size oneDNN tunes the blocked layout for


def available() -> bool:
    import torch

    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinears:
    """Installs packed forwards on every ``nn.Linear`` of ``model`` (fp32, CPU)."""

    def __init__(self, model: nn.Module, *, batch_invariant: bool = False) -> None:
        from torch import nn

        self.batch_invariant = batch_invariant
        self.layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self._packed: dict[int, torch.Tensor] = {}
        self.repack()
        for layer in self.layers:
            layer.forward = self._forward_of(layer)  # type: ignore[method-assign]  # per instance, on purpose

    def repack(self, storages: Collection[int] | None = None) -> int:
        """Pack again the layers whose weight lives in one of ``storages`` (``untyped_storage()
        .data_ptr()`` values; ``None``: every layer). Returns how many were packed."""
        import torch

        count = 0
        with torch.no_grad():
            for layer in self.layers:
                if storages is None or layer.weight.untyped_storage().data_ptr() in storages:
                    self._packed[id(layer)] = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), _PACK_HINT)
                    count += 1
        return count

    def _forward_of(self, layer: nn.Linear):
        import torch
        import torch.nn.functional as F

        packed = self._packed
        key = id(layer)
        pad_small = self.batch_invariant

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            if torch.is_grad_enabled() and layer.weight.requires_grad or rows < MIN_ROWS and not pad_small:
                return F.linear(x, layer.weight, layer.bias)
            flat = x.reshape(rows, x.shape[-1]).contiguous()
            if rows < MIN_ROWS:
                flat = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[-1])])
            out = torch.ops.mkldnn._linear_pointwise(flat, packed[key], layer.bias, "none", [], "")[:rows]
            return out.reshape(*x.shape[:-1], out.shape[-1])

        return forward
