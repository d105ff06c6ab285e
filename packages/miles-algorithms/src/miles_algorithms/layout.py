"""Padded and packed batches through the same functions.

The algorithms work on rows: padded ``[B, T]``, one rollout piece per row. A *packed* batch holds
several sequences back to back in one row ``[1, N]`` (no padding between them) and says where
each starts in ``batch.extras["cu_seqlens"]``: int64 ``[S + 1]``, ``0 = cu[0] < cu[1] < ... <=
N``. Its per-sequence tensors (``rewards``, ``group_ids``, ``rollout_ids``, and the
statistics of :func:`miles_algorithms.objective.prepare_batch`) then have ``S`` entries. Every
public function of :mod:`miles_algorithms.objective` views a packed batch as ``S`` padded rows,
computes, and returns per-token results in the packed layout again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import overload

import torch
from miles_contracts import TrainBatch

PACKED_KEY = "cu_seqlens"
_PER_SEQUENCE = ("rewards", "group_ids", "rollout_ids")


@dataclass(frozen=True, slots=True)
class Layout:
    """How per-token tensors of a batch map to rows. ``index is None``: already rows (identity).

    :ivar index: ``[S, L]`` long, packed column of row ``s``'s slot ``j``.
    :ivar valid: ``[S, L]`` bool, slot ``j`` exists in row ``s``.
    :ivar width: ``N``, the packed row's length.
    """

    index: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    width: int = 0

    @classmethod
    def of(cls, batch: TrainBatch) -> Layout:
        cu = batch.extras.get(PACKED_KEY)
        if cu is None:
            return cls()
        width = batch.tokens.shape[-1]
        cu = cu.to(torch.long)
        if batch.tokens.shape[0] != 1 or cu.dim() != 1 or len(cu) < 2:
            raise ValueError(
                f"a packed batch has one row [1, N] and extras['{PACKED_KEY}'] of shape [S + 1]; got tokens "
                f"{tuple(batch.tokens.shape)} and {PACKED_KEY} {tuple(cu.shape)}"
            )
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or (lengths <= 0).any() or int(cu[-1]) > width:
            raise ValueError(f"{PACKED_KEY} must start at 0, increase strictly and end at most at N={width}; got {cu.tolist()}")
        for name in _PER_SEQUENCE:
            size = getattr(batch, name).shape[0]
            if size != len(lengths):
                raise ValueError(f"packed batch: {name} has {size} entries but {PACKED_KEY} describes {len(lengths)} sequences")
        slots = torch.arange(int(lengths.max()), device=cu.device)
        valid = slots[None, :] < lengths[:, None]
        index = torch.where(valid, cu[:-1, None] + slots[None, :], torch.zeros_like(valid, dtype=torch.long))
        return cls(index, valid, width)

    @property
    def packed(self) -> bool:
        return self.index is not None

    @overload
    def to_rows(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def to_rows(self, x: None) -> None: ...
    @overload
    def to_rows(self, x: torch.Tensor | None) -> torch.Tensor | None: ...

    def to_rows(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``[1, N] -> [S, L]`` (0 in empty slots); identity for a padded batch."""
        if x is None or self.index is None:
            return x
        assert self.valid is not None  # set together with index
        picked = x[0][self.index]
        return torch.where(self.valid, picked, torch.zeros_like(picked))

    @overload
    def to_packed(self, y: torch.Tensor) -> torch.Tensor: ...
    @overload
    def to_packed(self, y: None) -> None: ...
    @overload
    def to_packed(self, y: torch.Tensor | None) -> torch.Tensor | None: ...

    def to_packed(self, y: torch.Tensor | None) -> torch.Tensor | None:
        """``[S, L] -> [1, N]`` (0 outside every sequence); identity for a padded batch."""
        if y is None or self.index is None:
            return y
        out = torch.zeros(1, self.width, dtype=y.dtype, device=y.device)
        out[0, self.index[self.valid]] = y[self.valid]
        return out

    def batch_rows(self, batch: TrainBatch) -> TrainBatch:
        """The batch as padded rows (a packed batch's per-sequence extras come along)."""
        if self.index is None:
            return batch
        per_token = {
            f.name: self.to_rows(getattr(batch, f.name))
            for f in fields(batch)
            if f.name not in (*_PER_SEQUENCE, "extras")
        }
        sequences = len(self.index)
        extras = {
            k: v for k, v in batch.extras.items() if k != PACKED_KEY and v.dim() == 1 and v.shape[0] == sequences
        }
        return replace(batch, **per_token, extras=extras)

    def restore(self, packed: TrainBatch, rows: TrainBatch, names: tuple[str, ...], extras: dict[str, torch.Tensor]) -> TrainBatch:
        """``packed`` with fields ``names`` taken from ``rows`` (repacked) and ``extras`` added."""
        if self.index is None:
            return replace(rows, extras={**rows.extras, **extras})
        updates = {name: self.to_packed(getattr(rows, name)) for name in names}
        return replace(packed, **updates, extras={**packed.extras, **extras})
