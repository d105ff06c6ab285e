"""Weights over Mooncake's transfer engine, for ``POST /update_weights_from_mooncake``.

The trainer registers one staging buffer with its transfer engine once, packs each bucket into it
and tells every engine where the bucket lies (:class:`UpdateWeightsFromMooncakeRequest`: the
trainer engine's session id, the bucket's address and the layout of its tensors, JSON only). Each
engine pulls the bytes into a buffer it registered with its own transfer engine
(:class:`MooncakeReceiver`) and copies the tensors into its model: RDMA where the hosts have it
(``protocol: rdma``), TCP otherwise. A Miles extension of the engine API: SGLang has no such
route.

Both sides use ``mooncake.engine.TransferEngine`` in peer-to-peer mode (``P2PHANDSHAKE``: no
metadata server) through :func:`open_transfer_engine`. The module is imported inside functions:
importing this one is free, and a process without Mooncake fails only when it is used, with the
install command.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_contracts.wire.engine import Name

if TYPE_CHECKING:
    import torch

MOONCAKE_PATH = "/update_weights_from_mooncake"
Protocol = Literal["tcp", "rdma"]
INSTALL_HINT = ("pip install 'miles-mooncake[cpu]' (no GPU), 'miles-mooncake[cuda12]' or 'miles-mooncake[cuda13]'; "
                "the CPU build also needs libibverbs (apt-get install libibverbs1)")


class MooncakeError(RuntimeError):
    """Mooncake is missing, or one of its calls failed (the message names which)."""


class MooncakeTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]
    offset: int = Field(ge=0)  # bytes from the bucket's start
    nbytes: int = Field(ge=0)


class UpdateWeightsFromMooncakeRequest(BaseModel):
    """``POST /update_weights_from_mooncake``: pull one bucket from the trainer and load it."""

    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(description="the trainer transfer engine's host:rpc_port")
    protocol: Protocol = "tcp"
    address: int = Field(ge=0, description="where the bucket starts in the trainer's registered buffer")
    size: int = Field(ge=0, description="bytes to pull")
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
    """A started transfer engine and its session id (``host:rpc_port``, what peers address it by).

    :param hostname: this host's address as its peers reach it (loopback when all are local).
    :param device_name: RDMA devices (``mlx5_0,mlx5_1``); empty: Mooncake discovers them.
    """
    engine = import_transfer_engine()()
    if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
        raise MooncakeError(f"Mooncake transfer engine did not start on {hostname} over {protocol} "
                            f"(device {device_name or 'auto'}); see its log above")
    return engine, f"{_bracketed(hostname)}:{engine.get_rpc_port()}"


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
    """The engine's side: one transfer engine and one registered receive buffer, grown when a
    bucket does not fit, used by one pull at a time."""

    def __init__(self, protocol: Protocol, hostname: str, device: torch.device | str = "cpu") -> None:
        self.protocol = protocol
        self.engine, self.session_id = open_transfer_engine(hostname, protocol)
        self.device = device
        self._buffer: torch.Tensor | None = None  # [capacity] uint8, registered
        self._lock = threading.Lock()

    def pull(self, request: UpdateWeightsFromMooncakeRequest) -> list[tuple[str, torch.Tensor]]:
        """Read the bucket into the receive buffer; returns views of its tensors, valid until the
        next pull (copy them out before)."""

        with self._lock:
            buffer = self._reserve(request.size)
            if request.size:
                status = self.engine.transfer_sync_read(request.session_id, buffer.data_ptr(), request.address,
                                                        request.size)
                if status < 0:
                    raise MooncakeError(f"pulling {request.size} bytes from {request.session_id} failed "
                                        f"(transfer_sync_read returned {status}); is the trainer still running?")
            out = []
            for meta in request.tensors:
                if meta.offset + meta.nbytes > request.size:
                    raise ValueError(f"tensor {meta.name} ends at byte {meta.offset + meta.nbytes}, past the "
                                     f"bucket's {request.size}")
                raw = buffer[meta.offset: meta.offset + meta.nbytes]
                out.append((meta.name, raw.view(_dtype(meta.dtype)).reshape(meta.shape)))
            return out

    def _reserve(self, size: int) -> torch.Tensor:
        import torch

        if self._buffer is not None and self._buffer.numel() >= size:
            return self._buffer
        if self._buffer is not None:
            self.engine.unregister_memory(self._buffer.data_ptr())
        capacity = max(size, 1 << 20)
        buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        if self.engine.register_memory(buffer.data_ptr(), capacity) != 0:
            self._buffer = None
            raise MooncakeError(f"registering a {capacity}-byte receive buffer with Mooncake failed")
        self._buffer = buffer
        return buffer


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype
