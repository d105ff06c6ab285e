"""Shared-memory packing: engines read exactly the trainer's bytes; files are reused, then removed."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

import pytest
import torch
from miles_contracts.weights import WeightBucket
from miles_contracts.wire.tensors import ShmBucket, read_shm_bucket, shm_dir
from miles_weights.packing import ShmArena
from miles_weights.prefetch import prefetched


def _bucket(seed: int, n: int = 4) -> WeightBucket:
    generator = torch.Generator().manual_seed(seed)
    return WeightBucket([
        ("fp32", torch.randn(3, 5, generator=generator)),
        ("bf16", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("transposed", torch.randn(4, 6, generator=generator).t()),
        ("int", torch.arange(n, dtype=torch.int64)),
    ])


def _files() -> set[Path]:
    return set(shm_dir().glob("miles-weights-*"))


def test_an_engine_reads_back_every_tensor_bit_exactly() -> None:
    arena = ShmArena()
    try:
        bucket = _bucket(0)
        packed = arena.pack(bucket)
        assert packed.load_format == "flattened_shm"
        received = read_shm_bucket(ShmBucket.from_json(json.loads(packed.payload)))
        for (name, sent), (got_name, got) in zip(bucket.tensors, received, strict=True):
            assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)
        packed.release()
    finally:
        arena.close()


def test_files_are_reused_across_syncs_and_removed_on_close() -> None:
    before = _files()
    arena = ShmArena()
    first = arena.pack(_bucket(1))
    second = arena.pack(_bucket(2))  # both in flight: two files
    paths = {json.loads(p.payload)["path"] for p in (first, second)}
    first.release()
    second.release()
    again = arena.pack(_bucket(3))
    assert json.loads(again.payload)["path"] in paths  # no new file, no new page faults
    again.release()
    big = arena.pack(WeightBucket([("big", torch.ones(1 << 19))]))  # 2 MiB: grows a file
    big.release()
    assert len(_files() - before) == 2
    arena.close()
    assert _files() == before


def test_prefetch_keeps_order_and_releases_everything_even_on_error() -> None:
    released: list[int] = []
    with closing(prefetched(range(5), lambda i: i * 10, released.append)) as stream:
        assert [(i, p) for i, p in stream] == [(i, i * 10) for i in range(5)]
    assert released == [0, 10, 20, 30, 40]

    released.clear()
    with pytest.raises(RuntimeError, match="engine rejected"), closing(prefetched(range(5), lambda i: i, released.append)) as stream:
        for item, _ in stream:
            if item == 1:
                raise RuntimeError("engine rejected the bucket")
    assert sorted(released) == [0, 1, 2]  # the consumed ones and the one prepared ahead
