"""Messages between the driver and its trainer ranks: a JSON header plus raw tensor bytes.

One frame on the stream::

    b"MLT1" | header length (u32, big endian) | payload length (u64) | header (UTF-8 JSON) | payload

The header is ``{"kind": ..., ..., "value": <encoded>, "tensors": [<layout>...]}``. Values are JSON
with a few tagged forms (``{"$tensor": i}``, ``{"$path": "..."}``, ``{"$dc": "TrainBatch",
"fields": {...}}`` for an allow-listed set of dataclasses); tensor ``i`` is ``nbytes`` raw bytes at
``offset`` of the payload, with its dtype (from an allow-list) and shape in the layout. Decoding
builds tensors with ``torch.frombuffer`` and dataclasses by name from the allow-list: nothing that
arrives is unpickled or executed, whatever the peer sends. Lengths are bounded before anything is
allocated; a peer that is not yet authenticated gets a small header bound.

torch is imported only when a tensor is encoded or decoded.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from miles_contracts import TrainBatch, TransferReport
from miles_contracts.wire.tensors import TensorMeta, tensor_layout

from miles.errors import MilesError

MAGIC = b"MLT1"
_PREFIX = struct.Struct("!4sIQ")
MAX_HEADER = 64 << 20  # a TrainBatch header is a few hundred bytes; metrics a few KB
MAX_PAYLOAD = 1 << 40
_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
_DATACLASSES: dict[str, Any] = {"TrainBatch": TrainBatch, "TransferReport": TransferReport}
_TAGS = ("$tensor", "$path", "$dc", "$dict")


class WireError(MilesError):
    """A frame was malformed, too large, or the peer went away mid-frame."""


class PeerClosed(WireError):
    """The peer closed the stream between frames (a process that ended)."""


# ---------------------------------------------------------------------- values


def encode(value: Any, tensors: list[Any]) -> Any:
    """``value`` as JSON data; tensors are appended to ``tensors`` and referenced by index."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Path):
        return {"$path": str(value)}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, list | tuple):
        return [encode(v, tensors) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"only str keys cross to the trainer ranks, got {sorted(map(repr, value))[:3]}")
        out = {k: encode(v, tensors) for k, v in value.items()}
        return {"$dict": out} if len(out) == 1 and next(iter(out)) in _TAGS else out
    name = type(value).__name__
    if is_dataclass(value) and _DATACLASSES.get(name) is type(value):
        return {"$dc": name, "fields": {f.name: encode(getattr(value, f.name), tensors) for f in fields(value)}}
    raise TypeError(f"cannot send a {name} to the trainer ranks (JSON data, tensors, paths, "
                    f"{', '.join(_DATACLASSES)} only)")


def decode(data: Any, tensors: list[Any]) -> Any:
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1 and "$tensor" in data:
        index = data["$tensor"]
        if not isinstance(index, int) or not 0 <= index < len(tensors):
            raise WireError(f"tensor reference {index!r} out of range ({len(tensors)} tensors)")
        return tensors[index]
    if len(data) == 1 and "$path" in data:
        return Path(str(data["$path"]))
    if len(data) == 1 and "$dict" in data:
        return {k: decode(v, tensors) for k, v in dict(data["$dict"]).items()}
    if set(data) == {"$dc", "fields"}:
        cls = _DATACLASSES.get(data["$dc"])
        if cls is None:
            raise WireError(f"unknown dataclass {data['$dc']!r}; known: {', '.join(_DATACLASSES)}")
        return cls(**{k: decode(v, tensors) for k, v in dict(data["fields"]).items()})
    return {k: decode(v, tensors) for k, v in data.items()}


# ---------------------------------------------------------------------- frames


class Frame:
    """An encoded message, ready to send to any number of peers (encoded once)."""

    def __init__(self, header: dict[str, Any], value: Any = None) -> None:
        tensors: list[Any] = []
        header = {**header, "value": encode(value, tensors)}
        self._chunks: list[tuple[int, Any]] = []  # (offset in the payload, uint8 array)
        self.payload_size = 0
        if tensors:
            import torch

            named = [(str(i), t.detach().to("cpu").contiguous()) for i, t in enumerate(tensors)]
            metas, self.payload_size = tensor_layout(named)
            header["tensors"] = [[m.dtype, m.shape, m.offset, m.nbytes] for m in metas]
            self._chunks = [(m.offset, t.reshape(-1).view(torch.uint8).numpy()) for m, (_, t) in zip(metas, named, strict=True)]
        body = json.dumps(header, separators=(",", ":")).encode()
        self._head = _PREFIX.pack(MAGIC, len(body), self.payload_size) + body

    def send(self, sock: socket.socket) -> None:
        sock.sendall(self._head)
        position = 0
        for offset, data in self._chunks:
            if offset > position:
                sock.sendall(bytes(offset - position))
            sock.sendall(memoryview(data))
            position = offset + data.nbytes
        if self.payload_size > position:
            sock.sendall(bytes(self.payload_size - position))


def send(sock: socket.socket, header: dict[str, Any], value: Any = None) -> None:
    """Send one frame: ``header`` plus ``value`` (JSON data, tensors, allow-listed dataclasses)."""
    Frame(header, value).send(sock)


def receive(sock: socket.socket, *, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> dict[str, Any]:
    """Read one frame; returns its header with ``value`` decoded. Raises :class:`PeerClosed` when
    the stream ends between frames. Both lengths are checked before anything is allocated: a peer
    not yet authenticated is read with small limits (``max_payload=0``: no tensors)."""
    prefix = _read(sock, _PREFIX.size, between_frames=True)
    magic, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError(f"not a Miles trainer frame (magic {magic!r})")
    if header_len > max_header or payload_len > max_payload:
        raise WireError(f"frame too large: header {header_len} bytes (limit {max_header}), "
                        f"payload {payload_len} (limit {max_payload})")
    try:
        header = json.loads(_read(sock, header_len))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the parser's depth
        raise WireError(f"frame header is not JSON: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise WireError("frame header is not a JSON object")
    payload = _read(sock, payload_len) if payload_len else bytearray()
    tensors = _tensors(header.get("tensors") or [], payload)
    header["value"] = decode(header.get("value"), tensors)
    return header


def _tensors(layouts: list[Any], payload: bytearray) -> list[Any]:
    if not layouts:
        return []
    import torch

    out = []
    for layout in layouts:
        try:
            meta = TensorMeta("", *layout)
        except TypeError:
            raise WireError(f"bad tensor layout {layout!r}") from None
        if meta.dtype not in _DTYPES or meta.offset < 0 or meta.offset + meta.nbytes > len(payload):
            raise WireError(f"tensor layout {layout!r} is outside the payload or of an unknown dtype")
        dtype = getattr(torch, meta.dtype)
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=meta.nbytes, offset=meta.offset) \
            if meta.nbytes else torch.empty(0, dtype=torch.uint8)
        out.append(flat.view(dtype).reshape(meta.shape))
    return out


def _read(sock: socket.socket, n: int, *, between_frames: bool = False) -> bytearray:
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if count == 0:
            if got == 0 and between_frames:
                raise PeerClosed("the peer closed the connection")
            raise WireError(f"the peer closed the connection mid-frame ({got} of {n} bytes)")
        got += count
    return buffer


__all__ = ["MAGIC", "Frame", "PeerClosed", "WireError", "decode", "encode", "receive", "send"]
