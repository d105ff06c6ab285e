"""The memory-copy limits a weight sync is measured against, in the same run and byte count."""

from __future__ import annotations

import time


def copy_gbps(num_bytes: int, source: str, target: str, *, repeats: int = 5) -> float:
    """Best GB/s of one ``copy_`` of ``num_bytes`` from ``source`` to ``target`` memory (devices
    like ``cpu``, ``cuda:0``); both buffers are touched first, so no page fault is timed."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8, device=source)  # [num_bytes]
    dst = torch.zeros(num_bytes, dtype=torch.uint8, device=target)  # [num_bytes]
    devices = {torch.device(d) for d in (source, target) if torch.device(d).type == "cuda"}

    def sync() -> None:
        for device in devices:
            torch.cuda.synchronize(device)

    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9
