"""Pack a bucket into memory an engine on this host can map: ``/dev/shm`` files or one CUDA buffer.

``/dev/shm`` files are kept and reused from sync to sync (:class:`ShmArena`): a fresh file costs a
page fault and a zeroed page for every 4 KiB written, which would make packing about twice as slow
as the copy itself. The price is two buckets of ``/dev/shm`` held while the transport lives.

The files are readable by this user only (mode 0600) and named after the process that made them;
an arena removes, when it is created, the files of processes that are gone (a driver killed with
SIGKILL leaves its buckets behind), and ``miles weights cleanup`` does the same on demand.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_contracts.weights import WeightBucket
from miles_contracts.wire.tensors import (
    CUDA_IPC_FORMAT,
    SHM_FORMAT,
    ShmBucket,
    TensorMeta,
    create_shm_file,
    remove_stale_shm_files,
    shm_dir,
    tensor_layout,
)

from miles_weights.errors import WeightSyncError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_ALIGN = 256  # byte offset of every tensor: any dtype can be viewed there, and copies stay aligned
_GROW = 1 << 20  # /dev/shm files grow in whole MiB


def aligned_layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Where each tensor lives in one flat byte buffer, and the buffer's size."""
    return tensor_layout(tensors, _ALIGN)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]


@dataclass(slots=True)
class PackedBucket:
    """A bucket ready to send as ``load_format``; its memory stays valid until :meth:`release`.

    :ivar sglang_payload: the same memory as SGLang's ``flattened_bucket`` payload (CUDA only, when
        asked for), for engines that take SGLang's format rather than Miles' own.
    """

    load_format: str
    payload: str
    on_release: Callable[[], object] | None = None  # its result is ignored
    sglang_payload: str | None = None

    def release(self) -> None:
        release, self.on_release = self.on_release, None
        if release is not None:
            release()


@dataclass(slots=True, eq=False)
class _ShmFile:
    path: Path
    capacity: int
    data: torch.Tensor  # [capacity] uint8, mapped shared


class ShmArena:
    """Reusable ``/dev/shm`` files, one per bucket in flight. Thread-safe; :meth:`close` removes them."""

    def __init__(self) -> None:
        for orphan in remove_stale_shm_files():
            log.info("removed %s, left by a process that is gone", orphan)
        self._lock = threading.Lock()
        self._free: list[_ShmFile] = []
        self._files: list[_ShmFile] = []

    def pack(self, bucket: WeightBucket) -> PackedBucket:
        import json

        metas, size = aligned_layout(bucket.tensors)
        shm = self._acquire(size)
        try:
            for meta, (_, tensor) in zip(metas, bucket.tensors, strict=True):
                shm.data[meta.offset : meta.offset + meta.nbytes].copy_(_as_bytes(tensor))
        except Exception:
            self._give_back(shm)
            raise
        layout = ShmBucket(str(shm.path), size, metas)
        return PackedBucket(SHM_FORMAT, json.dumps(layout.to_json()), on_release=lambda: self._give_back(shm))

    def _give_back(self, shm: _ShmFile) -> None:
        with self._lock:
            if shm in self._files and shm not in self._free:
                self._free.append(shm)

    def close(self) -> None:
        with self._lock:
            for shm in self._files:
                shm.path.unlink(missing_ok=True)
            self._files.clear()
            self._free.clear()

    def _acquire(self, size: int) -> _ShmFile:
        with self._lock:
            fitting = sorted((f for f in self._free if f.capacity >= size), key=lambda f: f.capacity)
            if fitting:
                self._free.remove(fitting[0])
                return fitting[0]
            if self._free:  # too small: replace it by a larger one
                small = self._free.pop()
                self._files.remove(small)
                small.path.unlink(missing_ok=True)
            shm = self._create(size)
            self._files.append(shm)
            return shm

    @staticmethod
    def _create(size: int) -> _ShmFile:
        import torch

        capacity = max(_GROW, (size + _GROW - 1) // _GROW * _GROW)
        path = None
        try:
            path = create_shm_file(capacity)
            data = torch.from_file(str(path), shared=True, size=capacity, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            if path is not None:
                path.unlink(missing_ok=True)
            raise WeightSyncError(
                f"could not create a {capacity / 1e6:.0f} MB shared-memory file under {shm_dir()}: {exc}; "
                f"lower weights.bucket_mb or give /dev/shm more space"
            ) from exc
        return _ShmFile(path, capacity, data)


def pack_cuda_ipc(bucket: WeightBucket, *, sglang: bool = False) -> PackedBucket:
    """Copy ``bucket`` into one CUDA byte buffer on its first tensor's device and share views of it:
    the engine opens one IPC handle per bucket, not one per tensor. With ``sglang``, the same
    buffer is also described in SGLang's ``flattened_bucket`` payload."""
    import torch
    from miles_contracts.wire.tensors import serialize_cuda_ipc, serialize_sglang_bucket

    device = bucket.tensors[0][1].device
    metas, size = aligned_layout(bucket.tensors)
    flat = torch.empty(max(size, 1), dtype=torch.uint8, device=device)  # [size]
    views = []
    for meta, (name, tensor) in zip(metas, bucket.tensors, strict=True):
        raw = flat[meta.offset : meta.offset + meta.nbytes]
        raw.copy_(_as_bytes(tensor.to(device)), non_blocking=True)
        views.append((name, raw.view(tensor.dtype).view(tensor.shape)))
    torch.cuda.current_stream(device).synchronize()  # the engine reads on its own stream
    payload = serialize_cuda_ipc(views)
    del views
    return PackedBucket(CUDA_IPC_FORMAT, payload, on_release=lambda: flat,  # the closure holds the buffer
                        sglang_payload=serialize_sglang_bucket(flat, metas) if sglang else None)
