"""``mooncake``: buckets pulled by the engines from the trainer's memory with Mooncake's transfer engine.

The trainer starts one transfer engine, serving on ``mooncake.hostname`` only (loopback by default).
Per bucket it packs the tensors into a free staging buffer and hashes them (the next bucket is
packed while the engines pull the current one, so two buffers are in use at most), then posts
``/update_weights_from_mooncake`` to every engine with the buffer's address, the bucket's SHA-256
and its layout, JSON only, with the run's token; each engine pulls the bytes (RDMA read, or TCP),
checks the digest and loads them. Nothing is pickled and no file is shared, so engines may sit on
other hosts, when ``mooncake.hostname`` is the trainer's address on a network they share.

Mooncake serves a registered buffer to any peer that connects, with no authentication, so a buffer
is exposed only while engines pull from it: over TCP it is registered for that time and no longer
(registering is a bookkeeping call there, tens of microseconds). Over RDMA registration pins the
memory and maps it into the NIC, too slow to repeat per bucket: buffers stay registered and are
zeroed once every engine has the bucket. What a peer without the token can still do in that window
is in ``docs/design/security.md`` ("Mooncake").

Staging buffers live in host memory (pinned when CUDA is present), except with ``protocol: rdma``
and CUDA tensors, where they are GPU memory the NIC reads directly (GPUDirect RDMA; needs the CUDA
build of Mooncake). SGLang serves no such route: a sync to an engine that is not the embedded one
is refused before anything is paused.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from miles_contracts.weights import WeightBucket
from miles_contracts.wire.listeners import ListenerError, local_address
from miles_contracts.wire.mooncake import (
    MOONCAKE_PATH,
    MooncakeError,
    Protocol,
    bucket_digest,
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
    data: torch.Tensor  # [capacity] uint8
    registered: bool = False  # with the trainer's transfer engine

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
                 hostname: str = "127.0.0.1") -> None:
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
                if buffer.registered:
                    with suppress(Exception):
                        self._engine.unregister_memory(buffer.address)
            self._buffers.clear()
            self._free.clear()
        super().close()

    # ------------------------------------------------------------------ BucketedTransport

    def _check_targets(self, urls: list[str]) -> None:
        unreachable = engines_that_cannot_reach(self.hostname, urls)
        if unreachable:
            raise WeightSyncError(f"engine(s) {', '.join(unreachable)} run on another host, but the trainer's Mooncake "
                                  f"serves on {self.hostname} (mooncake.hostname; loopback by default, so that nothing "
                                  "beyond this host reaches it): set mooncake.hostname to this host's address on the "
                                  "private network the engines share")
        engines = self.engine_info(urls)
        other = [url for url, info in engines.items() if not info.miles_formats]
        if other:
            raise WeightSyncError(f"the mooncake transport needs engines that serve {MOONCAKE_PATH} (the embedded "
                                  f"engine); {', '.join(other)} do(es) not (SGLang has no such route): use "
                                  f"weights.transport=broadcast for them")
        if self._engine is None:
            try:
                self._engine, self.session_id = open_transfer_engine(self.hostname, self.protocol, self.device_name)
            except MooncakeError as exc:
                raise WeightSyncError(f"the mooncake transport cannot start: {exc}") from exc

    def _deliver(self, staged: Iterator[WeightBucket], urls: list[str], version: int) -> int:
        count = 0
        with closing(prefetched(staged, self._stage, self._release)) as stream:
            for count, (bucket, ready) in enumerate(stream, start=1):
                with self._exposed(ready.buffer):
                    self._calls.post_all(urls, MOONCAKE_PATH, ready.body,
                                         step=f"version {version}: {describe_bucket(count, bucket)} via mooncake {self.protocol}")
        return count

    @contextmanager
    def _exposed(self, buffer: _Buffer) -> Iterator[None]:
        """Registered while the engines pull from it: from here until every engine answered."""
        if not buffer.registered:
            self._register(buffer)
        try:
            yield
        finally:
            if self.protocol == "rdma":  # stays registered (see the module's docstring): keep nothing in it
                buffer.data.zero_()
            else:
                with self._lock:
                    self._engine.unregister_memory(buffer.address)
                    buffer.registered = False

    def _register(self, buffer: _Buffer) -> None:
        with self._lock:
            if self._engine.register_memory(buffer.address, buffer.capacity) != 0:
                raise WeightSyncError(f"registering a {buffer.capacity / 1e6:.0f} MB staging buffer "
                                      f"({buffer.data.device}) with Mooncake failed; lower weights.bucket_mb, or check "
                                      "the RDMA device (mooncake.device_name)")
            buffer.registered = True

    # ------------------------------------------------------------------ staging buffers

    def _stage(self, bucket: WeightBucket) -> _Staged:
        """Pack ``bucket`` into a staging buffer and hash it (on the prefetch thread)."""
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
                "sha256": bucket_digest(buffer.data[:size]),
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
        """A free buffer of at least ``size`` bytes on ``device``; allocates a new one (and drops a free
        one too small) only when none fits."""
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
                if stale[0].registered:
                    self._engine.unregister_memory(stale[0].address)
            capacity = max(_GROW, (size + _GROW - 1) // _GROW * _GROW)
            pinned = device == "cpu" and torch.cuda.is_available()
            buffer = _Buffer(torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pinned))
            self._buffers.append(buffer)
        if self.protocol == "rdma":  # registered once (see the module's docstring)
            self._register(buffer)
        return buffer


def engines_that_cannot_reach(hostname: str, urls: list[str]) -> list[str]:
    """The engine URLs of ``urls`` on other hosts when ``hostname`` (where the trainer's Mooncake
    serves) is a loopback address, which only this host reaches; no packet is sent."""
    if not _is_loopback(hostname):
        return []
    return [url for url in urls if not _is_this_host(urlsplit(url).hostname or "")]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(local_address(host)).is_loopback
    except ListenerError:
        return False


def _is_this_host(host: str) -> bool:
    try:
        local_address(host)
    except ListenerError:
        return False
    return True
