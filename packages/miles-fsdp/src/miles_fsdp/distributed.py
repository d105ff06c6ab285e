"""Process group and device for the backend: reuse the caller's group, or make one.

Three ways a backend can start:

* the caller already ran ``torch.distributed.init_process_group`` (tests, launchers): reuse it;
* ``torchrun`` set ``WORLD_SIZE`` > 1 in the environment: initialise from the environment;
* neither: a world of one, initialised over an in-memory ``HashStore`` (no port, no file), so the
  single-process path runs through exactly the same FSDP2 code as the multi-process one.

A group this module created is destroyed when the last backend using it closes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles.trainer.device import pick_device

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

_OWNED_USERS = 0  # backends alive on a group this module created


@dataclass(slots=True)
class DistContext:
    """Where this rank runs.

    :ivar rank: this process's rank in the default group.
    :ivar world_size: number of ranks.
    :ivar device: the device models and micro-batches live on.
    :ivar mesh: 1-D device mesh every model is sharded over.
    :ivar owns_group: True when this module initialised the group (and must destroy it).
    """

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_preference: str = "auto") -> DistContext:
    """Join (or create) the default process group and build the 1-D mesh."""
    global _OWNED_USERS
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = pick_device(device_preference)
    # gloo for CPU tensors (metrics, plans) and NCCL for CUDA tensors when on GPU
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    owns = False
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    if owns or _OWNED_USERS:
        _OWNED_USERS += 1
        owns = True
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistContext(dist.get_rank(), world, device, mesh, owns)


def release_distributed(ctx: DistContext) -> None:
    """Drop this backend's use of the group; destroy it if this module created it and nobody is left."""
    global _OWNED_USERS
    import torch.distributed as dist

    if not ctx.owns_group:
        return
    ctx.owns_group = False
    _OWNED_USERS = max(0, _OWNED_USERS - 1)
    if _OWNED_USERS == 0 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op for a world of one) and return it."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
