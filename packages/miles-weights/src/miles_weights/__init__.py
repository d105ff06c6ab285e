"""Weight transports for Miles: move HF-named tensors from the trainer into inference engines.

Registered names (``weights.transport``): ``disk`` (safetensors files), ``shared_memory``
(``/dev/shm`` for CPU tensors, CUDA IPC for CUDA tensors; engines on this host) and ``broadcast``
(a gloo / NCCL collective; engines anywhere). Every transport sends buckets of ``weights.bucket_mb``
between ``pause_generation`` and ``continue_generation`` and sets the engines' ``weight_version``;
``weights.check`` proves a sync bit-exact. See :mod:`miles_weights.sync` for the life of a sync.

Names below import lazily, so ``import miles_weights`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "BroadcastTransport": "miles_weights.broadcast",
    "DiskTransport": "miles_weights.disk",
    "SharedMemoryTransport": "miles_weights.shared_memory",
    "TransportOptions": "miles_weights.sync",
    "WeightSyncError": "miles_weights.errors",
    "WeightCheckError": "miles_weights.errors",
    "tensor_checksum": "miles_weights.checksums",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_weights' has no attribute {name!r}")
    return getattr(import_module(module), name)
