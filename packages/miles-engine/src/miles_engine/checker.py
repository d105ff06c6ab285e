"""``POST /weights_checker``: SGLang's check-mode actions on the embedded engine's weights.

``snapshot`` keeps a host copy of every checkpoint tensor; ``reset_tensors`` fills the weights
with random noise; ``compare`` fails unless every tensor equals its snapshot bit for bit;
``checksum`` reports a SHA-256 per tensor. A weight transport proves a sync with them on any
engine, SGLang included: snapshot (the engine holds the weights the trainer starts from), reset,
sync, compare. (The embedded engine's ``/fill_weights_noise`` and ``/weights_checksum`` go further:
they compare against the trainer's own checksums on every sync; SGLang names its fused tensors
differently, so only the snapshot route works there.)
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from miles_engine.weights import WeightStore


class WeightCheckFailed(ValueError):
    """``compare`` found tensors that differ from the snapshot (or there is no snapshot)."""


class WeightChecker:
    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._snapshot: dict[str, torch.Tensor] | None = None

    def snapshot(self) -> None:
        self._snapshot = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.store.synced.items()}

    def reset_tensors(self) -> int:
        return self.store.fill_noise(int.from_bytes(os.urandom(8), "little") >> 1)

    def compare(self) -> int:
        import torch

        if self._snapshot is None:
            raise WeightCheckFailed("no snapshot to compare with; send {\"action\": \"snapshot\"} first")
        differ = [name for name, tensor in self.store.synced.items()
                  if not _same_bits(tensor, self._snapshot.get(name, torch.empty(0)))]
        if differ:
            shown = ", ".join(differ[:8]) + (f", ... ({len(differ) - 8} more)" if len(differ) > 8 else "")
            raise WeightCheckFailed(f"check tensor equality failed: {len(differ)} of {len(self.store.synced)} "
                                    f"tensors differ from the snapshot: {shown}")
        return len(self.store.synced)

    def checksum(self) -> dict[str, Any]:
        """SGLang's answer shape: one entry per rank (the embedded engine has one)."""
        checksums = self.store.checksums()
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        rank: dict[str, Any] = {"checksums": checksums, "per_gpu_checksum": overall.hexdigest(),
                "parallelism_info": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                     "pp_size": 1, "rank": 0, "size": 1}}
        return {"ranks": [rank], "per_engine_checksum": hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()}


def _same_bits(tensor: torch.Tensor, expected: torch.Tensor) -> bool:
    import torch

    if tensor.shape != expected.shape or tensor.dtype != expected.dtype:
        return False
    ours = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return torch.equal(ours, expected.contiguous().reshape(-1).view(torch.uint8))
