"""``shared_memory``: buckets through memory both processes map, for engines on this host.

CPU tensors go as ``flattened_shm``: the bucket is packed into a ``/dev/shm`` file and only its
layout (JSON) crosses HTTP; the engine copies each tensor out. CUDA tensors go as ``cuda_ipc``: the
bucket is packed into one CUDA buffer on the trainer's device and its IPC handle is sent; the engine
copies device to device. The trainer holds each buffer until every engine answered, and packs the
next bucket while the engines load the current one (:mod:`miles_weights.prefetch`).

An SGLang engine gets the same CUDA buffer in SGLang's own format (``flattened_bucket``: a pickle
SGLang unpickles, one copy per tensor-parallel rank; see ``miles_contracts.wire.tensors``). SGLang
takes tensors from CUDA memory only.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import closing, suppress
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from miles_contracts.weights import WeightBucket
from miles_contracts.wire.tensors import SGLANG_BUCKET_FORMAT

from miles_weights.engine_info import EngineInfo
from miles_weights.errors import WeightSyncError
from miles_weights.packing import PackedBucket, ShmArena, pack_cuda_ipc
from miles_weights.prefetch import prefetched
from miles_weights.sync import BucketedTransport, TransportOptions, describe_bucket

if TYPE_CHECKING:
    from miles_contracts import RunContext


def _local_hosts() -> set[str]:
    hosts = {"localhost", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    with suppress(OSError):
        hosts.update(socket.gethostbyname_ex(socket.gethostname())[2])
    return hosts


def is_local(url: str) -> bool:
    """Whether ``url`` points at this host (loopback, or one of this host's names and addresses)."""
    host = urlsplit(url).hostname or ""
    return host.startswith("127.") or host in _local_hosts()


class SharedMemoryTransport(BucketedTransport):
    """Weights through ``/dev/shm`` (CPU tensors) or CUDA IPC (CUDA tensors) to engines on this host."""

    name = "shared_memory"

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self._arena = ShmArena()
        self._sglang_engines = False  # this sync also goes to engines that take SGLang's format

    @classmethod
    def from_context(cls, ctx: RunContext) -> SharedMemoryTransport:
        """The transport of the run of ``ctx`` (its ``weights`` and ``weight_transport`` sections)."""
        return cls(TransportOptions.from_config(ctx.config))

    def close(self) -> None:
        super().close()
        self._arena.close()

    def _check_targets(self, urls: list[str]) -> None:
        remote = [url for url in urls if not is_local(url)]
        if remote:
            raise WeightSyncError(
                f"the shared_memory transport needs every engine on this host, but {', '.join(remote)} "
                f"is not a local address; use weights.transport=broadcast (or disk on a shared filesystem)"
            )

    def _pack(self, bucket: WeightBucket) -> PackedBucket:
        if bucket.tensors[0][1].is_cuda:
            return pack_cuda_ipc(bucket, sglang=self._sglang_engines)
        if self._sglang_engines:
            raise WeightSyncError("an SGLang engine takes weights from CUDA memory only, but the trainer's tensors "
                                  "are on the CPU; train on CUDA, or use weights.transport=disk or broadcast")
        return self._arena.pack(bucket)

    def _deliver(self, staged: Iterator[WeightBucket], urls: list[str], version: int) -> int:
        engines = self.engine_info(urls, version)
        self._sglang_engines = any(not info.miles_formats for info in engines.values())
        count = 0
        with closing(prefetched(staged, self._pack, PackedBucket.release)) as stream:
            for count, (bucket, packed) in enumerate(stream, start=1):
                bodies = {url: _body(packed, info) for url, info in engines.items()}
                futures = self._calls.submit(urls, "POST", "/update_weights_from_tensor", bodies, per_engine=True,
                                             step=f"version {version}: {describe_bucket(count, bucket)} via {packed.load_format}")
                self._calls.collect(futures)
        return count


def _body(packed: PackedBucket, engine: EngineInfo) -> dict[str, Any]:
    """What one engine is sent for one bucket: Miles' payload, or SGLang's once per TP rank."""
    if engine.miles_formats or packed.sglang_payload is None:
        return {"serialized_named_tensors": [packed.payload], "load_format": packed.load_format, "flush_cache": False}
    return {"serialized_named_tensors": [packed.sglang_payload] * engine.tp_size,
            "load_format": SGLANG_BUCKET_FORMAT, "flush_cache": False}
