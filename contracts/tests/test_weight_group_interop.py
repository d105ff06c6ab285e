"""A trainer's weight group (``create_weight_group``) meets an engine that joins the way SGLang does.

SGLang cannot run here (CUDA only), so the engine side below is rebuilt from what SGLang 0.5.13's
``init_custom_process_group`` does with torch's public and private pieces: a ``tcp://``
rendezvous store, ``PrefixStore(group_name, store)`` over it, then torch's own
``_new_process_group_helper``. If the two sides disagreed on a single store key, the group would
never form (here: a timeout); gloo stands in for NCCL, and the store layout is the same for both.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from miles_contracts.wire.distributed import (  # noqa: E402
    create_weight_group,
    destroy_weight_group,
    flatten_bucket,
    unflatten_bucket,
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join_like_sglang(port: int, rank: int, world_size: int, group_name: str, timeout: timedelta):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), store, group_name=group_name,
                                         backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def test_a_trainer_group_and_an_sglang_style_engine_exchange_a_flattened_bucket():
    port, name, timeout = _free_port(), "miles-interop", timedelta(seconds=60)
    tensors = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)]
    received: dict[str, object] = {}

    def engine() -> None:
        try:
            group = _join_like_sglang(port, 1, 2, name, timeout)
            flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=group)
            received["tensors"] = unflatten_bucket(flat, ["a", "b"], [t.dtype for t in tensors],
                                                   [tuple(t.shape) for t in tensors])
            dist.destroy_process_group(group)
        except BaseException as exc:  # reported by the test thread
            received["error"] = exc

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    trainer = create_weight_group("gloo", "127.0.0.1", port, 0, 2, name, timeout=timeout)
    try:
        dist.broadcast(flatten_bucket(tensors), src=0, group=trainer)
        thread.join(60)
    finally:
        destroy_weight_group(trainer)
    assert "error" not in received, received.get("error")
    got = received["tensors"]
    assert [n for n, _ in got] == ["a", "b"]
    assert all(torch.equal(t, sent) for (_, t), sent in zip(got, tensors, strict=True))
