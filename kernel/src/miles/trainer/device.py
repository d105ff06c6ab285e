"""The device a train backend's rank computes on, from ``model.device`` and the rank's environment,
and handing its cached memory back to a colocated engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pick_device(preference: str) -> torch.device:
    """``auto``: CUDA when torch sees it, else the CPU. On CUDA a rank takes GPU ``LOCAL_RANK``
    (modulo the GPUs it sees: the executor may have narrowed ``CUDA_VISIBLE_DEVICES`` to one) and
    makes it the current device."""
    import torch

    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but torch sees no CUDA device; use model.device: cpu or auto")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def hand_back_cached_memory() -> None:
    """Return the blocks PyTorch's CUDA allocator keeps cached but unused (a train step's freed
    activations) to the device, so that an engine on the same GPU can take them back
    (``resources.release_engine_memory``). Without it they stay reserved by this process, and an
    engine resuming its KV cache finds the GPU as full as during the step. A process that never used
    CUDA (a CPU run) has nothing cached, and the call does nothing."""
    import torch

    torch.cuda.empty_cache()
