"""Small collectives the train backends' ranks share, without pickle.

torch's ``*_object`` collectives (``all_gather_object`` and kin) pickle what a rank sends and
unpickle what the others send: code execution for whoever can speak on the process group's
sockets. What ranks exchange here (metric names, which rank holds which weight shard) is plain
data, so it travels as JSON in a byte tensor: a length exchange, then the padded bytes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def _world(group: dist.ProcessGroup | None) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's tensors must live: the current GPU for an NCCL-only group (one a launcher
    made before the backend), else the CPU (the backends make theirs ``cpu:gloo,cuda:nccl``)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` in rank order (``[value]`` for one rank). ``value`` must be
    JSON-serialisable and comes back as JSON reads it (tuples as lists)."""
    import torch
    import torch.distributed as dist

    world = _world(group)
    if world == 1:
        return [json.loads(json.dumps(value))]
    device = _device(group)
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(part[: int(size)].cpu().numpy().tobytes()) for part, size in zip(parts, sizes, strict=True)]


def sum_over_ranks(metrics: dict[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum metric shares over the ranks of ``group``; ranks may have seen different keys (an idle
    rank sees none): the union of names is summed, a missing name counting 0."""
    import torch
    import torch.distributed as dist

    names = sorted(metrics)
    shared = _world(group) > 1
    if shared:
        names = sorted({name for part in all_gather_json(names, group) for name in part})
    values = torch.tensor([metrics.get(name, 0.0) for name in names], dtype=torch.float64)
    if shared:
        values = values.to(_device(group))
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return dict(zip(names, values.tolist(), strict=True))

