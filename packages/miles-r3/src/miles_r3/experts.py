"""Routed experts as they travel: the engine's payload, the sample's stash value, the batch tensor.

* **Wire** (what SGLang and the embedded engine return in ``meta_info.routed_experts``): base64
  of little-endian int32, ``[rows, layers, top_k]``, where ``layers`` is every decoder layer
  (SGLang; dense layers are zero) or only the MoE layers. :func:`decode_payload` reads either and
  keeps the MoE layers of the model's :class:`~miles_contracts.MoeLayerMap`.
* **Sample** (:data:`ROUTED_EXPERTS` in the stash): :class:`RoutedExperts`, ``[len(tokens) - 1,
  moe_layers, top_k]`` expert ids in the smallest integer type that holds ``num_experts + 1``
  values (uint8 up to 255 experts): 4x smaller than the wire's int32 for every released MoE.
* **Batch** (``TrainBatch.extra(ROUTED_EXPERTS)``): ``[B, T, moe_layers, top_k]`` of the same
  type, aligned with ``tokens``; ``num_experts`` marks a position without a record (each row's
  last token, which no model call ever fed, and padding).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from miles_contracts import CapturedPiece, CaptureError, MoeLayerMap, StashKey

from miles_r3 import ROUTED_EXPERTS_NAME

if TYPE_CHECKING:
    import torch


def id_dtype(num_experts: int) -> np.dtype:
    """Smallest integer type holding ids ``0 .. num_experts`` (``num_experts`` = no record)."""
    if num_experts <= np.iinfo(np.uint8).max:
        return np.dtype(np.uint8)
    if num_experts <= np.iinfo(np.int16).max:
        return np.dtype(np.int16)  # torch has no full uint16 support
    return np.dtype(np.int32)


@dataclass(frozen=True, slots=True, eq=False)
class RoutedExperts:
    """The experts each fed position of a sample went to.

    :ivar ids: ``[len(tokens) - 1, moe_layers, top_k]``: row ``i`` holds, per MoE layer, the experts
        token ``i`` was routed to when it was fed to the model.
    :ivar num_experts: experts per MoE layer (ids lie in ``[0, num_experts)``).
    """

    ids: np.ndarray
    num_experts: int

    @property
    def positions(self) -> int:
        return int(self.ids.shape[0])

    def __eq__(self, other: object) -> bool:  # arrays compare element-wise; a sample compares whole
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return self.num_experts == other.num_experts and bool(np.array_equal(self.ids, other.ids))

    __hash__ = None  # type: ignore[assignment]


def decode_payload(payload: Any, rows: int, layer_map: MoeLayerMap) -> np.ndarray:
    """``[rows, moe_layers, top_k]`` ids from one engine answer's ``meta_info.routed_experts``.

    Raises :class:`CaptureError` when the payload is not base64 of int32, its size does not divide
    into ``rows x layers x top_k`` for the model's layer count (all decoder layers, or the MoE
    layers), or an id is out of range.
    """
    k, moe = layer_map.top_k, len(layer_map.moe_layers)
    if not isinstance(payload, str):
        raise CaptureError(f"routed experts must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CaptureError(f"routed experts are not valid base64: {exc}") from None
    values = np.frombuffer(raw, dtype="<i4") if len(raw) % 4 == 0 else None
    if values is None or (rows == 0 and values.size) or (rows and values.size % (rows * k)):
        raise CaptureError(f"routed experts hold {len(raw)} bytes, not int32 rows of {k} experts for {rows} positions")
    layers = values.size // (rows * k) if rows else moe
    if layers not in (layer_map.num_layers, moe):
        raise CaptureError(f"routed experts have {layers} layers per position; the model has {layer_map.num_layers} "
                           f"decoder layers, {moe} of them MoE")
    table = values.reshape(rows, layers, k)
    if layers != moe:  # every decoder layer, as SGLang reports them: keep the MoE ones
        table = table[:, list(layer_map.moe_layers)]
    if table.size and (table.min() < 0 or table.max() >= layer_map.num_experts):
        raise CaptureError(f"routed experts hold ids outside [0, {layer_map.num_experts}): "
                           f"[{table.min()}, {table.max()}]")
    return table.astype(id_dtype(layer_map.num_experts))


def stitch(pieces: Sequence[CapturedPiece], positions: int, layer_map: MoeLayerMap) -> RoutedExperts:
    """Join the pieces (checked to tile ``[0, positions)``) into one :class:`RoutedExperts`."""
    parts = [decode_payload(p.payload, p.rows, layer_map)[: p.stop - p.start] for p in pieces]
    ids = np.concatenate(parts) if parts else np.zeros((0, len(layer_map.moe_layers), layer_map.top_k), np.uint8)
    if ids.shape[0] != positions:
        raise CaptureError(f"routed experts cover {ids.shape[0]} positions, the sample has {positions}")
    return RoutedExperts(np.ascontiguousarray(ids), layer_map.num_experts)


def to_batch(values: Sequence[RoutedExperts | None], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[B, width, moe_layers, top_k]``: row ``b``'s ids at columns ``[0, lengths[b] - 1)``,
    ``num_experts`` everywhere else (no record; rows without data are entirely unrecorded)."""
    import torch

    present = [v for v in values if v is not None]
    first = present[0]
    shape, experts = first.ids.shape[1:], first.num_experts
    odd = [i for i, v in enumerate(values) if v is not None and (v.ids.shape[1:] != shape or v.num_experts != experts)]
    if odd:
        raise ValueError(f"rows {odd} carry routed experts of another shape than {tuple(shape)} x {experts} experts")
    short = [i for i, (v, n) in enumerate(zip(values, lengths, strict=True)) if v is not None and v.positions != n - 1]
    if short:
        raise ValueError(f"rows {short}: routed experts must cover len(tokens) - 1 positions")
    dtype = id_dtype(experts)
    table = np.full((len(values), width, *shape), experts, dtype=dtype)
    for row, value in enumerate(values):
        if value is not None:
            table[row, : value.positions] = value.ids
    return torch.from_numpy(table)


ROUTED_EXPERTS: StashKey[RoutedExperts] = StashKey(ROUTED_EXPERTS_NAME, to_batch=to_batch)
"""Where a sample keeps its routed experts (and the name of their ``TrainBatch.extras`` tensor)."""
