"""``disk``: the trainer writes safetensors, every engine loads them with ``/update_weights_from_disk``.

One folder per sync, laid out like a sharded HF checkpoint (one ``model-NNNNN.safetensors`` per
bucket plus ``model.safetensors.index.json``), written under a hidden ``.partial`` name and renamed
when complete, so an engine never sees half a checkpoint. The files are written *before* engines
pause (generation goes on meanwhile) and the folder is removed once every engine answered, whether
the load succeeded or not: the trainer still holds the weights, so nothing is lost. Engines must see
the folder at the same path (same host, or a shared filesystem).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miles_contracts.weights import WeightBucket

from miles_weights.settings import WeightTransportSection
from miles_weights.sync import BucketedTransport, TransportOptions

if TYPE_CHECKING:
    import torch
    from miles_contracts import RunContext

INDEX_FILE = "model.safetensors.index.json"


@dataclass(slots=True)
class WrittenCheckpoint:
    """A complete sync folder: ``shards`` safetensors files, ``num_bytes`` of tensor data."""

    path: Path
    shards: list[str] = field(default_factory=list)
    num_bytes: int = 0


def _own_storage(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{name: contiguous tensor}``; safetensors refuses tensors sharing memory, so repeats are cloned."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors:
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen and tensor.numel() else tensor
        seen.add(pointer)
    return out


def write_checkpoint(buckets: Iterator[WeightBucket], folder: Path) -> WrittenCheckpoint:
    """Write one safetensors shard per bucket and the index into ``folder`` (created)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    written = WrittenCheckpoint(folder)
    weight_map: dict[str, str] = {}
    for index, bucket in enumerate(buckets, start=1):
        shard = f"model-{index:05d}.safetensors"
        save_file(_own_storage(bucket.tensors), str(folder / shard), metadata={"format": "pt"})
        written.shards.append(shard)
        written.num_bytes += bucket.nbytes
        weight_map.update(dict.fromkeys(bucket.names, shard))
    index_doc = {"metadata": {"total_size": written.num_bytes}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index_doc, indent=1))
    return written


class DiskTransport(BucketedTransport):
    """Weights through safetensors files in ``directory`` (see the module docstring)."""

    name = "disk"

    def __init__(self, directory: Path | str, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self.directory = Path(directory).expanduser().resolve()

    @classmethod
    def from_context(cls, ctx: RunContext) -> DiskTransport:
        """The transport of the run of ``ctx`` (its ``weights`` and ``weight_transport`` sections)."""
        extra = ctx.config.section("weight_transport", WeightTransportSection)
        directory = extra.disk_dir or ctx.require_run_dir("the disk transport without weight_transport.disk_dir") / "weight_sync"
        return cls(directory, TransportOptions.from_config(ctx.config))

    @contextmanager
    def _staged(self, buckets: Iterator[WeightBucket], version: int) -> Iterator[WrittenCheckpoint]:
        name = f"v{version}-{uuid.uuid4().hex[:8]}"
        partial = self.directory / f".{name}.partial"
        final = self.directory / name
        try:
            written = write_checkpoint(buckets, partial)
            partial.rename(final)
            written.path = final
            yield written
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)

    def _deliver(self, staged: WrittenCheckpoint, urls: list[str], version: int) -> int:
        self._calls.post_all(
            urls, "/update_weights_from_disk", {"model_path": str(staged.path), "flush_cache": False},
            step=f"version {version}: load {len(staged.shards)} safetensors shard(s) from {staged.path}",
        )
        return len(staged.shards)
