"""``broadcast``: a collective from the trainer (rank 0) to engines in other processes or hosts.

The first sync forms a standalone process group (``miles_contracts.wire.distributed``; the
trainer's default process group, if any, is untouched): every engine is asked to join through
``/init_weights_update_group`` while the trainer joins as rank 0. Engines take ``tp_size`` ranks
each when ``/server_info`` says so (SGLang), one otherwise. Per bucket, every engine is told
the names, dtypes and shapes (``/update_weights_from_distributed``), and the trainer broadcasts over
NCCL for CUDA tensors, gloo for CPU ones. Layout (``weight_transport.broadcast_format``):

* ``flattened_bucket`` (default): the bucket's raw bytes back to back in one buffer, one collective
  per bucket (``miles_contracts.wire.distributed.flatten_bucket``); SGLang takes the same
  ``load_format``. The next bucket is packed while the current one is on the wire, so the trainer
  holds at most two buckets' worth of extra memory.
* ``per_tensor``: one collective per tensor, no extra memory; for engines without the flattened
  format.

A collective cannot be cancelled: the trainer's side runs in a helper thread, and an engine that
answers with an error ends the wait at once with that error. The group is then abandoned (the
helper thread ends when the group's timeout expires) and the next sync forms a new one. A change of
targets, or ``close()``, makes the engines destroy the group (``/destroy_weights_update_group``).
An engine restarted since it joined (noticed through the ``uptime_s`` of ``/server_info``)
knows no group, so the group is re-formed before the sync.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from contextlib import closing, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from miles_contracts.weights import WeightBucket
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.distributed import FLATTENED_BUCKET_FORMAT

from miles_weights.errors import WeightSyncError
from miles_weights.prefetch import prefetched
from miles_weights.settings import BROADCAST_BACKENDS, BROADCAST_LAYOUTS, WeightTransportSection, default_of
from miles_weights.sync import BucketedTransport, TransportOptions, describe_bucket

_RESTART_TOLERANCE_S = 1.0  # clock reads and HTTP round trips; no engine restarts faster
LAYOUTS = BROADCAST_LAYOUTS  # weight_transport.broadcast_format
BACKENDS = BROADCAST_BACKENDS  # weight_transport.broadcast_backend
_DEFAULT_LAYOUT: str = default_of(WeightTransportSection, "broadcast_format")
_DEFAULT_BACKEND: str = default_of(WeightTransportSection, "broadcast_backend")


if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from miles_contracts import RunContext


def _release(flat: object) -> None:
    """Packed buffers are ordinary tensors: dropping the reference frees them."""


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def master_address_for(urls: list[str]) -> str:
    """Loopback when every engine is local, else this host's address on the route to the first
    remote engine (no packet is sent: connecting a UDP socket only picks the route)."""
    remote = [urlsplit(u).hostname or "" for u in urls if not _is_loopback(urlsplit(u).hostname or "")]
    if not remote:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((remote[0], 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise WeightSyncError(
            f"cannot find this host's address as seen from engine host {remote[0]} ({exc}); "
            f"set weight_transport.master_address to an address the engines can reach"
        ) from exc


def _started_at(server_info: Mapping[str, Any]) -> float | None:
    uptime = server_info.get("uptime_s")
    return time.time() - float(uptime) if isinstance(uptime, int | float) else None


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


@dataclass(slots=True, eq=False)
class _Group:
    """A formed weight group: its torch handle, the engines in it, and where the trainer sends from."""

    handle: dist.ProcessGroup
    name: str
    urls: list[str]
    device: torch.device
    started: dict[str, float | None]  # engine -> when its process started, if it says (to notice restarts)


class BroadcastTransport(BucketedTransport):
    """Weights through a gloo / NCCL broadcast from the trainer to every engine."""

    name = "broadcast"

    def __init__(self, options: TransportOptions | None = None, *, backend: str = _DEFAULT_BACKEND,
                 master_address: str | None = None, master_port: int | None = None,
                 group_timeout: float | None = None, layout: str = _DEFAULT_LAYOUT) -> None:
        super().__init__(options)
        if backend not in BACKENDS:
            raise ValueError(f"broadcast backend must be one of {', '.join(BACKENDS)} "
                             f"(weight_transport.broadcast_backend), got {backend!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"broadcast layout must be one of {', '.join(LAYOUTS)} "
                             f"(weight_transport.broadcast_format), got {layout!r}")
        self.backend = backend
        self.layout = layout
        self.master_address = master_address
        self.master_port = master_port
        self.group_timeout = timedelta(seconds=group_timeout or self.options.http_timeout)
        self._group: _Group | None = None

    @classmethod
    def from_context(cls, ctx: RunContext) -> BroadcastTransport:
        """The transport of the run of ``ctx`` (its ``weights`` and ``weight_transport`` sections)."""
        config = ctx.config
        extra = config.section("weight_transport", WeightTransportSection)
        return cls(TransportOptions.from_config(config), backend=extra.broadcast_backend,
                   master_address=extra.master_address, master_port=extra.master_port,
                   layout=extra.broadcast_format)

    @property
    def group_name(self) -> str | None:
        """Name of the weight group the engines joined, ``None`` before the first sync."""
        return self._group.name if self._group is not None else None

    def close(self) -> None:
        self._abandon_group()
        super().close()

    # ------------------------------------------------------------------ delivery

    def _deliver(self, staged: Iterator[WeightBucket], urls: list[str], version: int) -> int:
        count = 0
        with closing(prefetched(staged, self._flatten, _release)) as stream:
            for count, (bucket, flat) in enumerate(stream, start=1):
                if count == 1 and not self._group_usable(urls, version):  # checked once per sync
                    self._abandon_group()
                    self._group = self._form_group(urls, bucket.tensors[0][1], version)
                assert self._group is not None
                self._send(self._group, bucket, flat, count, version)
        return count

    def _flatten(self, bucket: WeightBucket) -> torch.Tensor | None:
        """The bucket as one buffer on the device the group sends from (``None`` per tensor)."""
        if self.layout != FLATTENED_BUCKET_FORMAT:
            return None
        import torch
        from miles_contracts.wire.distributed import flatten_bucket

        tensors = [t for _, t in bucket.tensors]
        device = self._send_device(tensors[0])
        flat = flatten_bucket(tensors, device)  # [bucket bytes] uint8
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the broadcast runs from another thread
        return flat

    def _send(self, group: _Group, bucket: WeightBucket, flat: torch.Tensor | None, index: int, version: int) -> None:
        """Ask every engine to receive ``bucket``, broadcast it, and wait until every engine
        copied it into its model."""
        import torch
        import torch.distributed as dist

        step = f"version {version}: {describe_bucket(index, bucket)} via {self._backend_of(group.device)} broadcast"
        body = {
            "names": bucket.names,
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket.tensors],
            "shapes": [list(t.shape) for _, t in bucket.tensors],
            "group_name": group.name,
            "flush_cache": False,
        }
        if flat is not None:
            body["load_format"] = FLATTENED_BUCKET_FORMAT

        def broadcast_bucket() -> None:
            if group.device.type == "cuda":
                torch.cuda.set_device(group.device)
            if flat is not None:
                dist.broadcast(flat.to(group.device), src=0, group=group.handle)
            else:
                for _, tensor in bucket.tensors:
                    dist.broadcast(tensor.detach().to(group.device).contiguous(), src=0, group=group.handle)
            if group.device.type == "cuda":
                torch.cuda.synchronize(group.device)

        futures = self._calls.submit(group.urls, "POST", "/update_weights_from_distributed", body, step=step)
        self._alongside_engines(broadcast_bucket, futures, step)
        self._calls.collect(futures)

    # ------------------------------------------------------------------ the group

    def _send_device(self, sample: torch.Tensor) -> torch.device:
        """Where the trainer's side of the collective lives: the tensors' device, unless the
        configured backend needs another (NCCL: the current GPU; gloo: the CPU)."""
        import torch

        if self.backend == "nccl" and sample.device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        if self.backend == "gloo":
            return torch.device("cpu")
        return sample.device

    def _group_usable(self, urls: list[str], version: int) -> bool:
        group = self._group
        return group is not None and group.urls == urls and not self._restarted(group, version)

    def _backend_of(self, device: torch.device) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if device.type == "cuda" else "gloo"

    def _form_group(self, urls: list[str], sample: torch.Tensor, version: int) -> _Group:
        import torch
        from miles_contracts.wire.distributed import create_weight_group

        device = self._send_device(sample)
        backend = self._backend_of(device)
        step = f"version {version}: form the {backend} weight group"
        infos = {url: self._server_info(url, step) for url in urls}
        ranks = {url: int(info.get("tp_size") or 1) for url, info in infos.items()}
        world_size = 1 + sum(ranks.values())
        address = self.master_address or master_address_for(urls)
        port = self.master_port or free_port(address)
        name = f"miles-weights-{uuid.uuid4().hex[:8]}"
        bodies, offset = {}, 1
        for url in urls:
            bodies[url] = {"master_address": address, "master_port": port, "rank_offset": offset,
                           "world_size": world_size, "group_name": name, "backend": backend}
            offset += ranks[url]

        def join() -> dist.ProcessGroup:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return create_weight_group(backend, address, port, 0, world_size, name, timeout=self.group_timeout)

        futures = self._calls.submit(urls, "POST", "/init_weights_update_group", bodies, step=step, per_engine=True)
        handle = self._alongside_engines(join, futures, f"{step} at {address}:{port}")
        self._calls.collect(futures)
        return _Group(handle, name, list(urls), device, {url: _started_at(info) for url, info in infos.items()})

    def _server_info(self, url: str, step: str) -> dict[str, Any]:
        return self._calls.get_optional(url, "/server_info", step=step) or {}

    def _restarted(self, group: _Group, version: int) -> bool:
        """Whether an engine restarted since it joined (a new process knows no group). Engines
        that report ``uptime_s`` (the embedded one) are checked; others are trusted."""
        for url in group.urls:
            before = group.started.get(url)
            now = _started_at(self._server_info(url, f"version {version}: check the weight group"))
            if before is not None and now is not None and abs(now - before) > _RESTART_TOLERANCE_S:
                return True
        return False

    def _abandon_group(self) -> None:
        """Leave a healthy group: engines drop it (best effort: a vanished engine has nothing to
        drop), then the trainer does. A broken group is only forgotten (see the module docstring)."""
        group, self._group = self._group, None
        if group is None:
            return
        from miles_contracts.wire.distributed import destroy_weight_group

        for url in group.urls:
            with suppress(httpx.HTTPError):
                httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": group.name}, timeout=5.0,
                           headers=auth_headers(), trust_env=False)
        destroy_weight_group(group.handle)

    def _alongside_engines(self, work: Callable[[], Any], futures: Mapping[str, Future[dict[str, Any]]], step: str) -> Any:
        """Run the trainer's side of a collective while the engines run theirs behind ``futures``.

        Returns ``work()``'s result. An engine error (or the trainer's own) raises at once; the
        group is then unusable and is dropped, so the next sync forms a new one.
        """
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = work()
            except BaseException as exc:  # handed to the waiting thread
                outcome["error"] = exc

        thread = threading.Thread(target=run, name="miles-weights-broadcast", daemon=True)
        thread.start()
        while thread.is_alive():
            done, waiting = wait(list(futures.values()), timeout=0.05, return_when=FIRST_EXCEPTION)
            failed = {url: f for url, f in futures.items() if f in done and f.exception() is not None}
            if failed:
                self._group = None  # our side of the collective stays stuck until the group's timeout
                self._calls.collect(failed)
            if not waiting:
                thread.join(timeout=0.05)
        if "error" in outcome:
            self._group = None
            error = outcome["error"]
            raise WeightSyncError(f"{step}: the trainer's side failed: {type(error).__name__}: {error}") from error
        return outcome.get("value")
