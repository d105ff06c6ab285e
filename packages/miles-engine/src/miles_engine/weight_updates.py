"""Weight updates of a running engine: from disk, same-host tensors, a broadcast group, Mooncake.

Each update runs on the scheduler thread between two forwards (no request ever sees a
half-copied tensor inside one forward), then sets ``weight_version`` to the request's
``weight_version`` when it gives one; otherwise the version stays, as in SGLang (weight syncs set
it with ``/update_weight_version`` once every bucket landed). Responses finished after the update
carry the new version. Bad updates raise :class:`~miles_engine.weights.WeightUpdateError`
before any tensor is touched.

What an update may name is bounded: a disk update reads only inside the allowed folders (the
model's own and ``EngineConfig.weight_dir``); a tensor update is JSON (``flattened_shm``) or CUDA
IPC handles read by a restricted unpickler (``cuda_ipc``, CUDA engines only); a broadcast group is
joined as a non-zero rank (the trainer hosts the group) within ``weight_group_timeout``, and a join
whose store address nobody listens on fails within seconds, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts.wire.distributed import FLATTENED_BUCKET_FORMAT, bucket_nbytes, unflatten_bucket
from miles_contracts.wire.engine import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from miles_contracts.wire.mooncake import UpdateWeightsFromMooncakeRequest
from miles_contracts.wire.tensors import (
    CUDA_IPC_FORMAT,
    SHM_FORMAT,
    ShmBucket,
    deserialize_cuda_ipc,
    read_shm_bucket,
)

from miles_engine.checker import WeightChecker
from miles_engine.weights import WeightStore, WeightUpdateError, confined, parse_dtype

if TYPE_CHECKING:
    from miles_engine.loading import LoadedModel
    from miles_engine.scheduler import Scheduler

TENSOR_FORMATS = (SHM_FORMAT, CUDA_IPC_FORMAT)


class WeightUpdates:
    def __init__(self, scheduler: Scheduler, loaded: LoadedModel, *, allowed_dirs: list[str] | None = None,
                 group_timeout: float = 300.0) -> None:
        self.scheduler = scheduler
        self.loaded = loaded
        self.store = WeightStore(loaded.model)
        self.checker = WeightChecker(self.store)
        self.groups: dict[str, Any] = {}
        self.allowed_dirs = [Path(d).expanduser().resolve() for d in allowed_dirs or ()]
        self.group_timeout = group_timeout
        self.receivers: dict[str, Any] = {}  # Mooncake protocol -> MooncakeReceiver, made on first use

    async def _run(self, load: Callable[[], int] | None, *, version: str | None, abort_all: bool) -> int:
        """On the scheduler thread: abort if asked, ``load`` (``None``: only the version moves),
        let derived copies of the changed weights follow, set the version."""
        scheduler = self.scheduler

        def job() -> int:
            if load is not None and "weights" in scheduler.memory.released:
                raise WeightUpdateError("the weights are released (/release_memory_occupation); "
                                        "POST /resume_memory_occupation before updating them")
            if abort_all:
                scheduler.abort(None, "aborted for a weight update (abort_all_requests)")
            count = 0
            if load is not None:
                try:
                    count = load()
                finally:  # a load that failed half way still changed what it wrote
                    scheduler.runner.weights_changed(self.store.take_changed())
            if version is not None:  # as SGLang: an update without a version keeps the current one
                scheduler.weight_version = version
            return count

        return await asyncio.wrap_future(scheduler.call(job))

    async def from_disk(self, request: UpdateWeightsFromDiskRequest) -> int:
        if request.load_format not in (None, "auto", "safetensors"):
            raise WeightUpdateError(f"load_format {request.load_format!r} is not supported from disk; use 'safetensors'")
        folder = confined(request.model_path, self.allowed_dirs)
        return await self._run(lambda: self.store.load_from_disk(folder),
                               version=request.weight_version, abort_all=request.abort_all_requests)

    async def from_tensor(self, request: UpdateWeightsFromTensorRequest) -> int:
        if len(request.serialized_named_tensors) != 1:
            raise WeightUpdateError(f"serialized_named_tensors has {len(request.serialized_named_tensors)} payloads; "
                                    "the embedded engine has one rank and takes exactly one")
        payload = request.serialized_named_tensors[0]
        on_cuda = self.loaded.device.type == "cuda"
        # No format named: SGLang's default (CUDA IPC handles) on a CUDA engine, shared memory on CPU.
        fmt = request.load_format or (CUDA_IPC_FORMAT if on_cuda else SHM_FORMAT)
        if fmt not in TENSOR_FORMATS:
            raise WeightUpdateError(f"load_format {fmt!r} is not supported; use one of {', '.join(TENSOR_FORMATS)}")
        if fmt == CUDA_IPC_FORMAT and not on_cuda:
            raise WeightUpdateError("load_format 'cuda_ipc' needs an engine on CUDA; this engine runs on CPU, "
                                    f"send {SHM_FORMAT!r}")
        if fmt == SHM_FORMAT:
            try:
                bucket = ShmBucket.from_json(json.loads(payload))
            except (ValueError, KeyError, TypeError) as exc:
                raise WeightUpdateError(f"flattened_shm payload is not a ShmBucket JSON: {exc}") from exc
            named = _read_bucket(bucket)
        else:
            try:
                named = deserialize_cuda_ipc(payload)
            except Exception as exc:
                raise WeightUpdateError(f"cannot open the cuda_ipc payload: {type(exc).__name__}: {exc}") from exc
        self.store.check((n, tuple(t.shape)) for n, t in named)
        return await self._run(lambda: self.store.load(named), version=request.weight_version,
                               abort_all=request.abort_all_requests)

    async def init_group(self, request: InitWeightsUpdateGroupRequest) -> None:
        from miles_contracts.wire.distributed import StoreUnreachable, create_weight_group

        if request.backend == "nccl" and self.loaded.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs an engine on CUDA; this engine runs on CPU, use 'gloo'")
        if not 1 <= request.rank_offset < request.world_size:
            raise WeightUpdateError(f"rank_offset must be in [1, world_size) = [1, {request.world_size}): the trainer is "
                                    f"rank 0 and hosts the group; an engine never does (got {request.rank_offset})")
        if request.group_name in self.groups:
            raise WeightUpdateError(f"weight group {request.group_name!r} exists; destroy it first "
                                    "(/destroy_weights_update_group) or use another group_name")
        if self.loaded.device.type == "cuda" and self.loaded.device.index is not None:
            import torch

            torch.cuda.set_device(self.loaded.device)  # a bare "cuda" is the current device already
        # Joining blocks until the trainer (rank 0) joins too, at most group_timeout: keep it off the
        # event loop, on a daemon thread (one still waiting must not hold the process at exit).
        timeout = self.group_timeout
        try:
            group = await _on_daemon_thread(
                create_weight_group, request.backend, request.master_address, request.master_port,
                request.rank_offset, request.world_size, request.group_name, timedelta(seconds=timeout),
            )
        except StoreUnreachable as exc:  # within seconds, not the whole weight_group_timeout
            raise WeightUpdateError(f"could not join weight group {request.group_name!r}: {exc}") from exc
        except (RuntimeError, OSError, ValueError) as exc:  # torch reports store and connect timeouts as these
            raise WeightUpdateError(
                f"could not join weight group {request.group_name!r} at {request.master_address}:{request.master_port} "
                f"within {timeout:g} s (weight_group_timeout): {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        self.groups[request.group_name] = (group, request.backend)

    def destroy_group(self, group_name: str) -> None:
        from miles_contracts.wire.distributed import destroy_weight_group

        entry = self.groups.pop(group_name, None)
        if entry is None:
            raise WeightUpdateError(f"no weight group named {group_name!r}")
        destroy_weight_group(entry[0])

    async def from_distributed(self, request: UpdateWeightsFromDistributedRequest) -> int:
        if request.load_format not in (None, FLATTENED_BUCKET_FORMAT):
            raise WeightUpdateError(f"load_format {request.load_format!r} is not supported for a distributed update; "
                                    f"use {FLATTENED_BUCKET_FORMAT!r} (one broadcast per bucket) or none (one per tensor)")
        entry = self.groups.get(request.group_name)
        if entry is None:
            raise WeightUpdateError(f"no weight group named {request.group_name!r}; call /init_weights_update_group first")
        if not len(request.names) == len(request.dtypes) == len(request.shapes):
            raise WeightUpdateError(f"names, dtypes and shapes differ in length "
                                    f"({len(request.names)}, {len(request.dtypes)}, {len(request.shapes)})")
        dtypes = [parse_dtype(d) for d in request.dtypes]
        shapes = [tuple(s) for s in request.shapes]
        self.store.check(zip(request.names, shapes, strict=True))
        group, backend = entry
        device = self.loaded.device if backend == "nccl" else "cpu"

        def receive_all() -> int:
            import torch
            import torch.distributed as dist

            if request.load_format == FLATTENED_BUCKET_FORMAT:
                flat = torch.empty(bucket_nbytes(dtypes, shapes), dtype=torch.uint8, device=device)
                dist.broadcast(flat, src=0, group=group)
                return self.store.load(unflatten_bucket(flat, request.names, dtypes, shapes))
            received = []
            for name, dtype, shape in zip(request.names, dtypes, shapes, strict=True):
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(buffer, src=0, group=group)
                received.append((name, buffer))
            return self.store.load(received)

        return await self._run(receive_all, version=request.weight_version, abort_all=request.abort_all_requests)

    async def from_mooncake(self, request: UpdateWeightsFromMooncakeRequest) -> int:
        """Pull one bucket with Mooncake's transfer engine (off the scheduler thread, generation is
        paused around syncs anyway), then load it between two forwards."""
        from miles_contracts.wire.mooncake import MooncakeError

        self.store.check((t.name, tuple(t.shape)) for t in request.tensors)
        try:
            receiver = self._receiver(request)
            named = await asyncio.to_thread(receiver.pull, request)
        except (MooncakeError, ValueError, RuntimeError, OSError) as exc:  # OSError: a session host that does not resolve
            raise WeightUpdateError(f"cannot pull the bucket over Mooncake: {exc}") from exc
        return await self._run(lambda: self.store.load(named), version=request.weight_version,
                               abort_all=request.abort_all_requests)

    def _receiver(self, request: UpdateWeightsFromMooncakeRequest) -> Any:
        from miles_contracts.wire.mooncake import MooncakeReceiver, address_towards, session_host

        receiver = self.receivers.get(request.protocol)
        if receiver is None:
            # RDMA can land in GPU memory directly; TCP goes through host memory
            on_device = request.protocol == "rdma" and self.loaded.device.type == "cuda"
            receiver = MooncakeReceiver(request.protocol, address_towards(session_host(request.session_id)),
                                        self.loaded.device if on_device else "cpu")
            self.receivers[request.protocol] = receiver
        return receiver

    async def set_version(self, version: str, *, abort_all: bool) -> None:
        await self._run(None, version=version, abort_all=abort_all)

    async def fill_noise(self, seed: int) -> int:
        """Check mode: every weight becomes noise; the version is left as it is, since the noise
        is replaced by the next sync before the version moves."""
        def fill() -> int:
            count = self.store.fill_noise(seed)
            self.scheduler.runner.weights_changed()
            return count

        return await asyncio.wrap_future(self.scheduler.call(fill))

    async def check(self, action: str) -> dict[str, Any]:
        """``/weights_checker``: snapshot, reset_tensors, compare or checksum (:mod:`miles_engine.checker`);
        returns what the answer carries besides success and message."""
        checker, runner = self.checker, self.scheduler.runner

        def reset() -> None:
            checker.reset_tensors()
            runner.weights_changed()

        actions: dict[str, Callable[[], Any]] = {"snapshot": checker.snapshot, "reset_tensors": reset,
                                                 "compare": checker.compare, "checksum": checker.checksum}

        def run() -> dict[str, Any]:
            if "weights" in self.scheduler.memory.released:
                raise WeightUpdateError("the weights are released; POST /resume_memory_occupation first")
            result = actions[action]()
            return result if isinstance(result, dict) else {}

        return await asyncio.wrap_future(self.scheduler.call(run))

    async def checksums(self) -> dict[str, str]:
        return await asyncio.wrap_future(self.scheduler.call(self.store.checksums))

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)


async def _on_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``await fn(*args)`` run on a new daemon thread (``asyncio.to_thread`` uses pool threads,
    which the interpreter waits for at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def work() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed to the awaiting task
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the engine shut down)
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name="miles-engine-weight-group", daemon=True).start()
    return await future


def _read_bucket(bucket: ShmBucket) -> list:
    try:
        return read_shm_bucket(bucket)
    except (ValueError, OSError, RuntimeError) as exc:
        raise WeightUpdateError(f"cannot read shared-memory bucket {bucket.path}: {exc}") from exc
