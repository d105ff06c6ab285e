"""A standalone process group for weight broadcast, for ``/update_weights_from_distributed``.

The trainer (rank 0) and every engine (ranks ``rank_offset ...``) call :func:`create_weight_group`
with the same address, port, world size and group name. Per request, the trainer then broadcasts
(``torch.distributed.broadcast(..., src=0, group=group)``) and each engine receives with the same
call, in one of two layouts chosen by the request's ``load_format``:

* ``None``: one broadcast per tensor, in the order of the request's ``names``;
* ``"flattened_bucket"`` (:data:`FLATTENED_BUCKET_FORMAT`, SGLang's name for it): one broadcast of a
  ``uint8`` buffer holding every tensor's raw bytes back to back, in the order of ``names``, with no
  padding (:func:`flatten_bucket` / :func:`unflatten_bucket`). One collective instead of hundreds.

The group never touches the default process group: a trainer that already runs FSDP under
``torch.distributed.init_process_group`` keeps its world, and an engine needs no world at all. It is
built like ``torch.distributed.new_group`` builds one (a ``ProcessGroup`` over a gloo or NCCL
backend, on a ``TCPStore`` of its own) and registered so that the public collectives accept it;
``src`` / ``group_src`` are ranks inside this group (the mapping is the identity).

torch is imported inside functions; importing this module is free.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
FLATTENED_BUCKET_FORMAT = "flattened_bucket"
_DEFAULT_TIMEOUT = timedelta(minutes=10)
STORE_CONNECT_TIMEOUT = timedelta(seconds=10)
"""How long a joining rank waits for rank 0's store to accept a connection. Rank 0 opens it as it
joins, at the same moment the engines are asked to (milliseconds apart); a port where nothing
listens after this long is a wrong address or a trainer that is gone, not a slow one. (torch's
store client keeps retrying for the whole group timeout: 300 s on an engine.)"""


class StoreUnreachable(ConnectionError):
    """Nothing accepted a connection at the group's store address; the message names it."""


def create_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = _DEFAULT_TIMEOUT,
    connect_timeout: timedelta = STORE_CONNECT_TIMEOUT,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a process group of ``world_size`` ranks. A gloo group is connected when
    this returns (it blocks until every rank joined); an NCCL group connects at its first collective.
    Another rank first waits at most ``connect_timeout`` (and at most ``timeout``) for rank 0's
    store to accept a connection and raises :class:`StoreUnreachable` naming the address if it
    does not; after that the whole join has ``timeout``.

    :param backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; call
        ``torch.cuda.set_device`` first).
    :param master_address: host of rank 0, which serves the group's TCP store on ``master_port``.
    :param rank: this process's rank in the group (the trainer is 0).
    :param group_name: distinguishes groups sharing one store; also the name torch reports.
    :returns: a group for ``torch.distributed.broadcast(tensor, src=0, group=group)``.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-group backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
    if not 1 <= master_port <= 65535:  # TCPStore would raise an opaque TypeError (its port is a uint16)
        raise ValueError(f"master_port must be a TCP port in [1, 65535], got {master_port}")
    if rank != 0:
        wait_for_store(master_address, master_port, min(connect_timeout, timeout).total_seconds())
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
    )
    # The keys SGLang's engines use (its init_custom_process_group: a tcp:// rendezvous store,
    # PrefixStore(group_name) over it, then torch's own f"{group_name}/" and f"{device}/" layers),
    # so that a trainer here and a real SGLang server find each other's NCCL id in the store.
    prefix = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    group = dist.ProcessGroup(prefix, rank, world_size)
    backend_type = dist.ProcessGroup.BackendType.GLOO if backend == "gloo" else dist.ProcessGroup.BackendType.NCCL
    group._set_default_backend(backend_type)
    # As torch builds it: one backend on the store prefix of the first device type it serves,
    # registered for every one (gloo: cpu, and cuda through host memory; NCCL: cuda).
    devices = ("cpu", "cuda") if backend == "gloo" else ("cuda",)
    impl = _backend(backend, dist.PrefixStore(f"{devices[0]}/", prefix), rank, world_size, timeout, master_address)
    for device in devices:
        group._register_backend(torch.device(device), backend_type, impl)
    group._set_group_name(group_name)  # type: ignore[arg-type]
    # What torch.distributed.new_group records, so broadcast(group=...) can map ranks; the
    # group's own store is kept alive by the reference held here.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    c10d._world.pg_map[group] = (backend, prefix)
    c10d._world.pg_names[group] = group_name  # type: ignore[assignment]
    # No collective here: an SGLang engine runs none after joining, so the first one is the first
    # weight broadcast (NCCL connects then; gloo connected while constructing).
    return group


def wait_for_store(address: str, port: int, within: float) -> None:
    """Return once something accepts a TCP connection at ``address:port`` (rank 0's store); try
    again until ``within`` seconds have passed, then raise :class:`StoreUnreachable`."""
    import socket
    import time

    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(0.1, min(left, 2.0))):
                return
        except OSError as exc:
            if time.monotonic() + 0.1 >= deadline:
                raise StoreUnreachable(
                    f"nothing accepts connections at {address}:{port}, where rank 0 (the trainer) hosts the weight "
                    f"group's store, after {within:g} s ({exc.strerror or exc}); check the master address and "
                    "port, and that the trainer is running") from None
        time.sleep(0.1)


def _backend(name: str, store: Any, rank: int, world_size: int, timeout: timedelta, address: str) -> Any:
    import torch.distributed as dist

    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    # Bind to the interface that reaches the master: on one host that is loopback, which keeps
    # gloo from picking an address the peers cannot reach.
    device = dist.ProcessGroupGloo.create_device(hostname=address) if _is_loopback(address) \
        else dist.ProcessGroupGloo.create_default_device()
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    """Leave the group and forget it (the next :func:`create_weight_group` may reuse the port)."""
    from torch.distributed import distributed_c10d as c10d

    for registry in (c10d._world.pg_group_ranks, c10d._world.pg_map, c10d._world.pg_names):
        registry.pop(group, None)
    # older torch has no shutdown(); a group whose peer is gone may refuse it
    with contextlib.suppress(AttributeError, RuntimeError):
        group.shutdown()


def bucket_nbytes(dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> int:
    """Size of a flattened bucket holding tensors of these dtypes and shapes."""
    import math

    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes, strict=True))


def flatten_bucket(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Every tensor's raw bytes back to back in one new ``uint8`` buffer on ``device`` (default:
    the first tensor's)."""
    import torch

    device = tensors[0].device if device is None else torch.device(device)
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        flat[offset : offset + nbytes].copy_(tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8))
        offset += nbytes
    return flat


def unflatten_bucket(flat: torch.Tensor, names: list[str], dtypes: list[torch.dtype],
                     shapes: list[tuple[int, ...]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors inside a flattened bucket: views where the byte offset suits the dtype,
    copies where it does not (no padding means a float32 may follow an odd count of bfloat16s)."""
    import math

    expected = bucket_nbytes(dtypes, shapes)
    if flat.numel() != expected:
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes, its tensors need {expected}")
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = math.prod(shape) * dtype.itemsize
        raw = flat[offset : offset + nbytes]
        if (raw.data_ptr() % dtype.itemsize) != 0:
            raw = raw.clone()  # a fresh allocation is aligned for any dtype
        out.append((name, raw.view(dtype).reshape(shape)))
        offset += nbytes
    return out
