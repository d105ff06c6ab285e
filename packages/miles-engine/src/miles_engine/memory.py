"""Release and resume the engine's memory for colocated runs (SGLang's ``/release_memory_occupation``).

A colocated run trains on the GPU the engine serves from: between rollouts the engine hands back
its memory and takes it again before the next one. Tags say what: ``kv_cache`` (the KV cache),
``cuda_graph`` (captured decode graphs and their memory pool), ``weights`` (every weight storage).
No tag means all three.

Weights are kept, not dropped: each device storage is copied to host memory and its allocation is
freed by resizing the storage to zero bytes (every view of it, the parameter, a tied alias, the
weight store's handles, stays valid as an object); resuming reallocates it and copies the bytes
back. So a resumed engine serves the weights it had, and the next weight sync overwrites them as
usual. SGLang without ``--enable-weights-cpu-backup`` loses them instead; a client that always
syncs after resuming works with both. Captured CUDA graphs hold the old addresses and are dropped
whenever weights or the KV cache move.

The KV cache comes back at the capacity it had (slots x length), as SGLang's fixed pool does: a
cache regrown from nothing by the next rollout would be reallocated several times as it doubles,
and every reallocation drops the captured decode graphs. (They are captured again after a resume
all the same: the new cache has new addresses.)

Only an idle engine releases (SGLang asserts the same): pause with ``mode: abort`` first, or wait
for the requests to finish. While anything is released the scheduler admits nothing; requests
that arrive wait until every tag is resumed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from miles_engine.scheduler import Scheduler

TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryStateError(ValueError):
    """A release or resume that cannot be done now (requests in flight, tag not released ...)."""


class MemoryOccupation:
    """What the engine has released, and how to take it back. Runs on the scheduler thread."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.released: set[str] = set()
        self._weights: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # device storage, host copy
        self._kv_capacity = (0, 0)  # slots, length of the KV cache when it was released

    def release(self, tags: Iterable[str] | None) -> list[str]:
        wanted = _tags(tags)
        scheduler = self.scheduler
        if scheduler.has_work():
            raise MemoryStateError(f"release_memory_occupation needs an idle engine, but {len(scheduler.running)} "
                                   f"request(s) run and {len(scheduler.waiting)} wait; pause with mode 'abort' first")
        runner = scheduler.runner
        if "kv_cache" in wanted and "kv_cache" not in self.released:
            self._kv_capacity = (runner.cache.slots, runner.cache.length)
            runner.cache.k = runner.cache.v = None  # even a kept allocation (graphs are dropped below)
            runner.cache.slots = runner.cache.length = 0
            if runner.prefix is not None:  # cached prefixes go too (the next rollout has new weights anyway)
                runner.prefix.drop_memory()
        if "weights" in wanted and "weights" not in self.released:
            self._weights = [(storage, _host_copy(storage)) for storage in _weight_storages(runner.model)]
            for storage, _ in self._weights:
                storage.resize_(0)
        if runner.graphs is not None and wanted & {"weights", "kv_cache", "cuda_graph"}:
            runner.graphs.reset()
        self.released |= wanted
        _empty_device_cache(runner.device)
        return sorted(wanted)

    def resume(self, tags: Iterable[str] | None) -> list[str]:
        wanted = _tags(tags)
        if "weights" in wanted and "weights" in self.released:
            for storage, host in self._weights:
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage())
            self._weights = []
            self.scheduler.runner.weights_changed()  # derived copies (CPU pre-packed linears) follow
        slots, length = self._kv_capacity
        if "kv_cache" in wanted and "kv_cache" in self.released and slots and length:
            runner = self.scheduler.runner
            runner.cache.reserve(slots, length, max_slots=runner.max_slots, max_length=runner.loaded.context_length)
        self.released -= wanted
        return sorted(wanted)

    @property
    def holding(self) -> bool:
        """Whether anything is released (the scheduler then admits nothing)."""
        return bool(self.released)


def _tags(tags: Iterable[str] | None) -> set[str]:
    wanted = set(tags or TAGS)
    unknown = sorted(wanted - set(TAGS))
    if unknown:
        raise MemoryStateError(f"unknown memory tag(s) {unknown}; use {', '.join(TAGS)}")
    return wanted


def _weight_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """Every distinct device storage behind the model's parameters and persistent buffers. Host
    storages stay: releasing is for accelerator memory, and weights loaded on the CPU are often
    memory-mapped from the checkpoint (not resizable)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in model.state_dict(keep_vars=True).values():
        storage = tensor.untyped_storage()
        if storage.device.type != "cpu" and storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _host_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    import torch

    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # [nbytes] view
    pinned = storage.device.type == "cuda"
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
    host.copy_(source)
    return host


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
