"""Targets are validated before anything is paused; an unreachable engine is named in the error;
what the broadcast transport packs per bucket in each layout."""

from __future__ import annotations

import pytest
import torch
from miles.executor.local import free_port
from miles_contracts.weights import WeightBucket
from miles_contracts.wire.distributed import unflatten_bucket
from miles_weights.broadcast import BroadcastTransport, master_address_for
from miles_weights.engines import EngineCalls, normalize_targets
from miles_weights.errors import WeightSyncError
from miles_weights.shared_memory import SharedMemoryTransport, is_local
from miles_weights.sync import TransportOptions


def test_targets_are_normalised_and_bad_ones_rejected() -> None:
    assert normalize_targets("http://127.0.0.1:1/") == ["http://127.0.0.1:1"]
    with pytest.raises(ValueError, match="not a base URL"):
        normalize_targets(["127.0.0.1:30000"])
    with pytest.raises(ValueError, match="listed twice"):
        normalize_targets(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="no engine targets"):
        normalize_targets([])


def test_an_unreachable_engine_is_named_with_the_step() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    calls = EngineCalls(timeout=5)
    try:
        with pytest.raises(WeightSyncError, match=rf"pause generation: cannot reach engine {url}"):
            calls.post_all([url], "/pause_generation", {}, step="pause generation")
    finally:
        calls.close()


def test_push_rejects_bad_arguments_before_contacting_engines() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with SharedMemoryTransport(TransportOptions(bucket_mb=1)) as transport:
        with pytest.raises(ValueError, match="no tensors"):
            transport.push([], targets=[url], version=1)
        with pytest.raises(ValueError, match="non-negative int"):
            transport.push([("w", torch.zeros(1))], targets=[url], version=-1)
        with pytest.raises(WeightSyncError, match="needs every engine on this host"):
            transport.push([("w", torch.zeros(1))], targets=["http://10.255.255.1:30000"], version=1)
        with pytest.raises(WeightSyncError, match=f"cannot reach engine {url}"):
            transport.push([("w", torch.zeros(1))], targets=[url], version=1)


def test_local_addresses() -> None:
    assert is_local("http://127.0.0.1:5") and is_local("http://localhost:5")
    assert not is_local("http://10.255.255.1:5")


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="bucket_mb"):
        TransportOptions(bucket_mb=0)
    with pytest.raises(ValueError, match="pause_mode"):
        TransportOptions(pause_mode="sleep")


def test_broadcast_master_address() -> None:
    assert master_address_for(["http://127.0.0.1:1", "http://localhost:2"]) == "127.0.0.1"
    try:
        address = master_address_for(["http://10.255.255.1:30000"])
    except WeightSyncError as exc:  # a sandbox without any route: the error says what to set
        assert "weight_transport.master_address" in str(exc)
    else:
        assert not address.startswith("127.")


def test_broadcast_packs_a_bucket_into_one_buffer_only_in_the_flattened_layout() -> None:
    """What the wire carries per bucket: one uint8 buffer of the bucket's bytes (flattened_bucket),
    or nothing packed (per_tensor sends the tensors themselves)."""
    bucket = WeightBucket([("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(5, dtype=torch.bfloat16))])
    with BroadcastTransport(backend="gloo") as flattened, BroadcastTransport(backend="gloo", layout="per_tensor") as plain:
        flat = flattened._flatten(bucket)
        assert plain._flatten(bucket) is None
    assert flat is not None and flat.dtype == torch.uint8 and flat.numel() == bucket.nbytes == 34
    back = unflatten_bucket(flat, bucket.names, [t.dtype for _, t in bucket.tensors], [tuple(t.shape) for _, t in bucket.tensors])
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(back, bucket.tensors, strict=True))
    with pytest.raises(ValueError, match="layout must be one of flattened_bucket, per_tensor"):
        BroadcastTransport(layout="zip")
