"""Weights over Mooncake's transfer engine, for ``POST /update_weights_from_mooncake``.

The trainer packs each bucket into a staging buffer and tells every engine where the bucket lies
(:class:`UpdateWeightsFromMooncakeRequest`: the trainer engine's session id, the bucket's address,
its SHA-256 and the layout of its tensors, JSON only). Each engine pulls the bytes with its own
transfer engine (:class:`MooncakeReceiver`), checks them against the digest and copies the tensors
into its model: RDMA where the hosts have it (``protocol: rdma``), TCP otherwise. A Miles extension
of the engine API: SGLang has no such route.

Both sides use ``mooncake.engine.TransferEngine`` in peer-to-peer mode (``P2PHANDSHAKE``: no
metadata server) through :func:`open_transfer_engine`. Mooncake has no authentication and listens on
every interface; :func:`open_transfer_engine` holds its listeners to the one address it is given
(:mod:`miles_contracts.wire.listeners`), and the digest, which travels with the run's token, is what
makes a bucket that anyone else wrote into fail (``docs/design/security.md``, "Mooncake"). The
module is imported inside functions: importing this one is free, and a process without Mooncake
fails only when it is used, with the install command.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_contracts.wire.engine import Name
from miles_contracts.wire.listeners import (
    ListenerError,
    hold_to_address,
    local_address,
    new_listeners,
    wildcard_listeners,
)

if TYPE_CHECKING:
    import torch

MOONCAKE_PATH = "/update_weights_from_mooncake"
Protocol = Literal["tcp", "rdma"]
INSTALL_HINT = ("pip install 'miles-mooncake[cpu]' (no GPU), 'miles-mooncake[cuda12]' or 'miles-mooncake[cuda13]'; "
                "the CPU build also needs libibverbs (apt-get install libibverbs1)")


class MooncakeError(RuntimeError):
    """Mooncake is missing, or one of its calls failed (the message names which)."""


ADDRESS_LIMIT = 1 << 64
"""Addresses are unsigned 64-bit integers in Mooncake; a larger one is refused with a 400."""
SIZE_LIMIT = 1 << 63
"""Sizes and offsets index one torch tensor of bytes (a signed 64-bit count); a larger one is a 400."""
DIGEST_CHUNK_BYTES = 64 << 20


class BucketTampered(ValueError):
    """The pulled bytes are not the ones the trainer packed: nothing of the bucket is loaded."""


class MooncakeTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]
    offset: int = Field(ge=0, lt=SIZE_LIMIT)  # bytes from the bucket's start
    nbytes: int = Field(ge=0, lt=SIZE_LIMIT)


class UpdateWeightsFromMooncakeRequest(BaseModel):
    """``POST /update_weights_from_mooncake``: pull one bucket from the trainer and load it."""

    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(max_length=300, pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$",
                            description="the trainer transfer engine's host:rpc_port")
    protocol: Protocol = "tcp"
    address: int = Field(ge=0, lt=ADDRESS_LIMIT, description="where the bucket starts in the trainer's registered buffer")
    size: int = Field(ge=0, lt=SIZE_LIMIT, description="bytes to pull")
    sha256: str = Field(pattern="^[0-9a-f]{64}$", description="bucket_digest of the bucket's bytes, as the trainer "
                        "packed them; the engine loads nothing that does not match")
    tensors: list[MooncakeTensor]
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Name | None = None


def import_transfer_engine() -> Any:
    # Mooncake logs every connection at INFO; keep its warnings and errors (MC_LOG_LEVEL wins if set)
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeError(f"Mooncake's transfer engine cannot be imported ({exc}); {INSTALL_HINT}") from exc
    return TransferEngine


def open_transfer_engine(hostname: str, protocol: Protocol, device_name: str = "") -> tuple[Any, str]:
    """A started transfer engine and its session id (``host:rpc_port``, what peers address it by),
    whose listeners take connections made to ``hostname`` only.

    Mooncake binds its handshake and TCP data ports to every interface whatever ``hostname`` says;
    the ports it opens are held to ``hostname``'s address right after it starts
    (:func:`~miles_contracts.wire.listeners.hold_to_address`), so a peer that reaches this host
    through any other address gets no answer.

    :param hostname: the address this transfer engine serves on and its peers reach it at; it must be
        an address of this host (``127.0.0.1`` when every peer is local).
    :param device_name: RDMA devices (``mlx5_0,mlx5_1``); empty: Mooncake discovers them.
    """
    TransferEngine = import_transfer_engine()
    try:
        address = local_address(hostname)
    except ListenerError as exc:
        raise MooncakeError(f"Mooncake cannot serve on {hostname}: {exc}") from exc
    before = wildcard_listeners()
    engine = TransferEngine()
    if engine.initialize(address, "P2PHANDSHAKE", protocol, device_name) != 0:
        raise MooncakeError(f"Mooncake transfer engine did not start on {address} over {protocol} "
                            f"(device {device_name or 'auto'}); see its log above")
    opened = new_listeners(before)
    try:
        if not opened:
            raise ListenerError("found none of its listening sockets in /proc/self/fd")
        hold_to_address(opened, address)
    except (ListenerError, OSError) as exc:  # never leave it serving every interface
        for fd in opened:
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as listener:
                listener.shutdown(socket.SHUT_RDWR)  # stops it listening
        raise MooncakeError(f"cannot hold Mooncake's listeners to {address}: {exc}") from exc
    return engine, f"{_bracketed(address)}:{engine.get_rpc_port()}"


def bucket_digest(data: torch.Tensor) -> str:
    """SHA-256, as hex, of a bucket's bytes (``data``: [size] uint8): the SHA-256 of the SHA-256s of
    its 64 MiB chunks, hashed on up to 8 threads (hashlib releases the GIL). On an H200 host's 16
    cores a 512 MiB bucket hashes at 8.2 GB/s this way, 1.1 GB/s on one thread. A CUDA buffer is
    copied into pinned host memory first: 7.7 GB/s in all, against 1.2 GB/s through pageable memory
    (``docs/benchmarks/weights.md``)."""
    import torch

    if data.is_cuda:
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(data)
        data = host
    view = data.numpy().data.cast("B")
    chunks = [view[start: start + DIGEST_CHUNK_BYTES] for start in range(0, len(view), DIGEST_CHUNK_BYTES)]
    if len(chunks) > 1:
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="miles-digest") as pool:
            digests = list(pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))
    else:
        digests = [hashlib.sha256(chunk).digest() for chunk in chunks]
    return hashlib.sha256(b"".join(digests)).hexdigest()


def address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (loopback for a local peer); no packet is sent."""
    if peer in ("localhost", "::1") or peer.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        address: str = probe.getsockname()[0]
        return address


def session_host(session_id: str) -> str:
    return session_id.rsplit(":", 1)[0].strip("[]")


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class MooncakeReceiver:
    """The engine's side: one transfer engine and a receive buffer reused from pull to pull (grown when
    a bucket does not fit), used by one pull at a time.

    A registered buffer is one any peer that reaches the transfer engine can read and write, so the
    bytes that are checked and loaded are never in one. Over TCP the receive buffer is not registered
    at all (Mooncake's TCP side needs registration only where it is read or written from afar). Over
    RDMA the NIC can land bytes only in registered memory: each pull is copied into a private buffer,
    and the registered one is zeroed.
    """

    def __init__(self, protocol: Protocol, hostname: str, device: torch.device | str = "cpu") -> None:
        self.protocol = protocol
        self.engine, self.session_id = open_transfer_engine(hostname, protocol)
        self.device = device
        self._private: torch.Tensor | None = None  # [capacity] uint8, never registered
        self._landing: torch.Tensor | None = None  # [capacity] uint8, registered (RDMA only)
        self._lock = threading.Lock()

    def pull(self, request: UpdateWeightsFromMooncakeRequest) -> list[tuple[str, torch.Tensor]]:
        """Read the bucket and check it against ``request.sha256``; returns views of its tensors, valid
        until the next pull (copy them out before). :class:`BucketTampered` when the bytes differ."""
        for meta in request.tensors:
            if meta.offset + meta.nbytes > request.size:
                raise ValueError(f"tensor {meta.name} ends at byte {meta.offset + meta.nbytes}, past the "
                                 f"bucket's {request.size}")
        with self._lock:
            private = self._private = _grown(self._private, request.size, self.device)
            if self.protocol == "rdma":
                landing = self._landing = self._registered(request.size)
                self._read(request, landing)
                private[:request.size].copy_(landing[:request.size])
                landing[:request.size].zero_()
            else:
                self._read(request, private)
            if bucket_digest(private[:request.size]) != request.sha256:
                raise BucketTampered(f"the {request.size} bytes pulled from {request.session_id} do not match the "
                                     "digest the trainer sent: they changed after it packed them (a process that "
                                     "reached its Mooncake port wrote into the buffer?); nothing was loaded")
            out = []
            for meta in request.tensors:
                raw = private[meta.offset: meta.offset + meta.nbytes]
                out.append((meta.name, raw.view(_dtype(meta.dtype)).reshape(meta.shape)))
            return out

    def _read(self, request: UpdateWeightsFromMooncakeRequest, into: torch.Tensor) -> None:
        if not request.size:
            return
        status = self.engine.transfer_sync_read(request.session_id, into.data_ptr(), request.address, request.size)
        if status < 0:
            raise MooncakeError(f"pulling {request.size} bytes from {request.session_id} failed "
                                f"(transfer_sync_read returned {status}); is the trainer still running?")

    def _registered(self, size: int) -> torch.Tensor:
        if self._landing is not None and self._landing.numel() >= size:
            return self._landing
        if self._landing is not None:
            self.engine.unregister_memory(self._landing.data_ptr())
            self._landing = None
        buffer = _grown(None, size, self.device)
        if self.engine.register_memory(buffer.data_ptr(), buffer.numel()) != 0:
            raise MooncakeError(f"registering a {buffer.numel()}-byte receive buffer with Mooncake failed")
        return buffer


def _grown(buffer: torch.Tensor | None, size: int, device: torch.device | str) -> torch.Tensor:
    """``buffer`` when it holds ``size`` bytes, else a new one (at least 1 MiB)."""
    import torch

    if buffer is not None and buffer.numel() >= size:
        return buffer
    return torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device)


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype
