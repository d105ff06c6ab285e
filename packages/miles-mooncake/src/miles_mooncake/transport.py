"""``mooncake``: buckets pulled by the engines from the trainer's memory with Mooncake's transfer engine.

The trainer starts one transfer engine and keeps staging buffers registered with it for the life of
the transport (registration pins memory and, over RDMA, maps it into the NIC: too slow to repeat
per bucket). Per bucket it packs the tensors into a free buffer (the next bucket is packed while the
engines pull the current one, so two buffers are in use at most) and posts
``/update_weights_from_mooncake`` to every engine with the buffer's address and the bucket's layout,
JSON only; each engine pulls the bytes into its own registered buffer (RDMA read, or TCP) and loads
them. Nothing is pickled and no file is shared, so engines may sit on other hosts; they must reach
the trainer's address (``mooncake.hostname``, default: this host's address on the route to the
first engine, loopback when all are local).

Staging buffers live in host memory (pinned when CUDA is present), except with ``protocol: rdma``
and CUDA tensors, where they are GPU memory the NIC reads directly (GPUDirect RDMA; needs the CUDA
build of Mooncake). SGLang serves no such route: a sync to an engine that is not the embedded one
is refused before anything is paused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import closing, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from miles_contracts.weights import WeightBucket
from miles_contracts.wire.mooncake import (
    MOONCAKE_PATH,
    MooncakeError,
    Protocol,
    address_towards,
    open_transfer_engine,
)
from miles_weights.errors import WeightSyncError
from miles_weights.packing import aligned_layout
from miles_weights.prefetch import prefetched
from miles_weights.sync import BucketedTransport, TransportOptions, describe_bucket

if TYPE_CHECKING:
    import torch
    from miles_contracts import RunContext

_GROW = 1 << 20


@dataclass(slots=True, eq=False)
class _Buffer:
    data: torch.Tensor  # [capacity] uint8, registered with the trainer's transfer engine

    @property
    def address(self) -> int:
        return self.data.data_ptr()

    @property
    def capacity(self) -> int:
        return self.data.numel()


@dataclass(slots=True)
class _Staged:
    buffer: _Buffer
    body: dict[str, Any]


class MooncakeTransport(BucketedTransport):
    """Weights through Mooncake's transfer engine: engines pull each bucket from the trainer."""

    name = "mooncake"

    def __init__(self, options: TransportOptions | None = None, *, protocol: Protocol = "tcp", device_name: str = "",
                 hostname: str | None = None) -> None:
        super().__init__(options)
        self.protocol = protocol
        self.device_name = device_name
        self.hostname = hostname
        self._engine: Any = None
        self.session_id: str | None = None
        self._lock = threading.Lock()
        self._free: list[_Buffer] = []
        self._buffers: list[_Buffer] = []

    @classmethod
    def from_context(cls, ctx: RunContext) -> MooncakeTransport:
        """The transport of the run of ``ctx`` (its ``weights`` and ``weight_transport`` sections)."""
        from miles_mooncake.settings import MooncakeSection

        section = ctx.config.section("mooncake", MooncakeSection)
        return cls(TransportOptions.from_config(ctx.config), protocol=section.protocol, device_name=section.device_name,
                   hostname=section.hostname)

    def close(self) -> None:
        with self._lock:
            for buffer in self._buffers:
                with suppress(Exception):
                    self._engine.unregister_memory(buffer.address)
            self._buffers.clear()
            self._free.clear()
        super().close()

    # ------------------------------------------------------------------ BucketedTransport

    def _check_targets(self, urls: list[str]) -> None:
        engines = self.engine_info(urls)
        other = [url for url, info in engines.items() if not info.miles_formats]
        if other:
            raise WeightSyncError(f"the mooncake transport needs engines that serve {MOONCAKE_PATH} (the embedded "
                                  f"engine); {', '.join(other)} do(es) not (SGLang has no such route): use "
                                  f"weights.transport=broadcast for them")
        if self._engine is None:
            host = self.hostname or address_towards(urlsplit(urls[0]).hostname or "127.0.0.1")
            try:
                self._engine, self.session_id = open_transfer_engine(host, self.protocol, self.device_name)
            except MooncakeError as exc:
                raise WeightSyncError(f"the mooncake transport cannot start: {exc}") from exc

    def _deliver(self, staged: Iterator[WeightBucket], urls: list[str], version: int) -> int:
        count = 0
        with closing(prefetched(staged, self._stage, self._release)) as stream:
            for count, (bucket, ready) in enumerate(stream, start=1):
                self._calls.post_all(urls, MOONCAKE_PATH, ready.body,
                                     step=f"version {version}: {describe_bucket(count, bucket)} via mooncake {self.protocol}")
        return count

    # ------------------------------------------------------------------ staging buffers

    def _stage(self, bucket: WeightBucket) -> _Staged:
        """Pack ``bucket`` into a registered buffer (on the prefetch thread)."""
        import torch

        metas, size = aligned_layout(bucket.tensors)
        sample = bucket.tensors[0][1]
        device = self._buffer_device(sample)
        buffer = self._acquire(size, device)
        try:
            for meta, (_, tensor) in zip(metas, bucket.tensors, strict=True):
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                buffer.data[meta.offset: meta.offset + meta.nbytes].copy_(raw, non_blocking=True)
            if sample.is_cuda or buffer.data.is_cuda:
                torch.cuda.synchronize()  # the engines read the buffer as soon as they are told
        except Exception:
            self._release(_Staged(buffer, {}))
            raise
        body = {"session_id": self.session_id, "protocol": self.protocol, "address": buffer.address, "size": size,
                "tensors": [{"name": m.name, "dtype": m.dtype, "shape": m.shape, "offset": m.offset, "nbytes": m.nbytes}
                            for m in metas],
                "flush_cache": False}
        return _Staged(buffer, body)

    def _release(self, staged: _Staged) -> None:
        with self._lock:
            if staged.buffer in self._buffers and staged.buffer not in self._free:
                self._free.append(staged.buffer)

    def _buffer_device(self, sample: torch.Tensor) -> str:
        return "cuda" if self.protocol == "rdma" and sample.is_cuda else "cpu"

    def _acquire(self, size: int, device: str) -> _Buffer:
        """A free registered buffer of at least ``size`` bytes on ``device``; registers a new one
        (and drops a free one too small) only when none fits."""
        import torch

        with self._lock:
            fitting = sorted((b for b in self._free if b.capacity >= size and b.data.device.type == device),
                             key=lambda b: b.capacity)
            if fitting:
                self._free.remove(fitting[0])
                return fitting[0]
            stale = [b for b in self._free if b.data.device.type == device]
            if stale:  # too small for this bucket: give its memory back
                self._free.remove(stale[0])
                self._buffers.remove(stale[0])
                self._engine.unregister_memory(stale[0].address)
            capacity = max(_GROW, (size + _GROW - 1) // _GROW * _GROW)
            pinned = device == "cpu" and torch.cuda.is_available()
            data = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pinned)
            if self._engine.register_memory(data.data_ptr(), capacity) != 0:
                raise WeightSyncError(f"registering a {capacity / 1e6:.0f} MB staging buffer ({device}) with Mooncake "
                                      "failed; lower weights.bucket_mb, or check the RDMA device (mooncake.device_name)")
            buffer = _Buffer(data)
            self._buffers.append(buffer)
            return buffer
