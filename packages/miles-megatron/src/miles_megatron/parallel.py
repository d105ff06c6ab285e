"""The process group and megatron-core's parallel state (TP, PP, CP, EP, DP groups).

Ranks start like ``torchrun`` starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...); a group
the caller already initialised is reused, and without either the backend makes a world of one over
an in-memory store. megatron-core keeps its parallel state in module globals, so every backend of a
process must use the same layout; backends share it and the last one to close tears it down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from miles_megatron import cpu_shim

if TYPE_CHECKING:
    from miles_megatron.config import MegatronSection

_USERS = 0  # backends alive on the current parallel state
_LAYOUT: Layout | None = None
_OWNS_GROUP = False


@dataclass(frozen=True, slots=True)
class Layout:
    """How ranks split the model. ``dp`` is derived: world / (tp * pp * cp)."""

    tp: int
    pp: int
    cp: int
    ep: int
    vpp: int | None
    dp: int

    @classmethod
    def of(cls, options: MegatronSection, world_size: int) -> Layout:
        per_replica = options.model_parallel
        if world_size % per_replica:
            raise ValueError(
                f"{world_size} ranks cannot be split into replicas of tensor_parallel x pipeline_parallel x "
                f"context_parallel = {options.tensor_parallel} x {options.pipeline_parallel} x "
                f"{options.context_parallel} = {per_replica}; choose sizes whose product divides the rank count"
            )
        dp = world_size // per_replica
        if (dp * options.context_parallel * options.tensor_parallel) % options.expert_parallel:
            raise ValueError(
                f"megatron.expert_parallel={options.expert_parallel} must divide data x context x tensor parallel "
                f"ranks ({dp * options.context_parallel * options.tensor_parallel})"
            )
        return cls(options.tensor_parallel, options.pipeline_parallel, options.context_parallel,
                   options.expert_parallel, options.virtual_pipeline, dp)


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in the layout (read from megatron-core once)."""

    rank: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(options: MegatronSection, device: torch.device, seed: int) -> tuple[Layout, Ranks]:
    """Join or create the process group, then initialise (or reuse) megatron-core's parallel state."""
    global _USERS, _LAYOUT, _OWNS_GROUP
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if device.type == "cpu" and not cpu_shim.needed():
        # megatron-core puts its gradient buffers (and with them the parameters) and bookkeeping
        # tensors on the current CUDA device whatever the model's device; the CPU shim that stops
        # it only runs where no GPU is present (it replaces torch.cuda functions process-wide)
        raise ValueError("the megatron backend runs on the CPU only on a host without a usable GPU: megatron-core "
                         "places its buffers on the current CUDA device. Use model.device: cuda (or auto), or hide "
                         "the GPUs (CUDA_VISIBLE_DEVICES='')")
    if device.type == "cpu":
        cpu_shim.install()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _OWNS_GROUP = True
    layout = Layout.of(options, dist.get_world_size())
    if _USERS and layout != _LAYOUT:
        raise RuntimeError(
            f"this process already runs a megatron backend with {_LAYOUT}; megatron-core's parallel state is "
            f"process-wide, so a second backend must use the same layout (asked for {layout})"
        )
    if not _USERS:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
        )
        if device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        else:
            cpu_shim.seed_model_parallel(seed)
        _LAYOUT = layout
    _USERS += 1
    ranks = Ranks(
        rank=dist.get_rank(), world_size=dist.get_world_size(), tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(), cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(), device=device,
    )
    return layout, ranks


def release() -> None:
    """One backend fewer; the last one destroys the parallel state (and the group, if made here)."""
    global _USERS, _LAYOUT, _OWNS_GROUP
    from megatron.core import parallel_state as ps

    _USERS = max(0, _USERS - 1)
    if _USERS:
        return
    _LAYOUT = None
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWNS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_GROUP = False


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """In place over ``group`` (the world by default); a no-op for one rank."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
