"""The disk transport's folder: one safetensors shard per bucket, an index, removed after the sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from miles_contracts.weights import bucketize
from miles_weights.disk import INDEX_FILE, DiskTransport, write_checkpoint
from miles_weights.sync import TransportOptions
from safetensors.torch import load_file


def _weights() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [(f"model.layers.{i}.w", torch.randn(256, 256)) for i in range(5)]  # 256 KiB each


def test_each_bucket_becomes_one_shard_and_the_index_maps_every_name(tmp_path: Path) -> None:
    tensors = _weights()
    written = write_checkpoint(bucketize(iter(tensors), 600 * 1024), tmp_path / "ckpt")
    assert written.shards == ["model-00001.safetensors", "model-00002.safetensors", "model-00003.safetensors"]
    index = json.loads((tmp_path / "ckpt" / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == {name for name, _ in tensors}
    assert index["metadata"]["total_size"] == written.num_bytes == 5 * 256 * 256 * 4
    loaded = {}
    for shard in written.shards:
        loaded.update(load_file(tmp_path / "ckpt" / shard))
    for name, tensor in tensors:
        assert torch.equal(loaded[name], tensor)


def test_tensors_sharing_memory_are_written_apart(tmp_path: Path) -> None:
    embed = torch.randn(4, 8)
    written = write_checkpoint(bucketize(iter([("embed", embed), ("lm_head", embed), ("view", embed[1:])]), 1 << 20),
                               tmp_path / "ckpt")
    loaded = load_file(tmp_path / "ckpt" / written.shards[0])
    assert torch.equal(loaded["lm_head"], embed) and torch.equal(loaded["view"], embed[1:])


def test_the_folder_is_complete_when_staged_and_gone_afterwards(tmp_path: Path) -> None:
    transport = DiskTransport(tmp_path / "sync", TransportOptions(bucket_mb=1))
    try:
        with transport._staged(bucketize(iter(_weights()), transport.options.bucket_bytes), version=7) as staged:
            assert staged.path.name.startswith("v7-") and (staged.path / INDEX_FILE).is_file()
            assert [p.name for p in (tmp_path / "sync").iterdir()] == [staged.path.name]  # no .partial left
        assert list((tmp_path / "sync").iterdir()) == []

        def failing():
            yield from _weights()[:2]
            raise RuntimeError("trainer died mid-sync")

        with pytest.raises(RuntimeError, match="mid-sync"), \
                transport._staged(bucketize(failing(), transport.options.bucket_bytes), version=8):
            pass
        assert list((tmp_path / "sync").iterdir()) == []
    finally:
        transport.close()
