"""Masked tensor helpers shared by every module (``masked`` and ``whiten`` are the kernel's, which
applies the same whitening to every estimator's advantages: :mod:`miles.advantages`).

Off-mask entries of per-token inputs can hold anything (padding, tool tokens, engine garbage).
They are replaced by a constant with ``torch.where`` *before* any arithmetic, never multiplied by
the mask: ``nan * 0`` is nan, and ``exp`` of a masked 1e4 would poison the backward pass even
where the forward result is discarded.
"""

from __future__ import annotations

import torch
from miles.advantages import masked as masked
from miles.advantages import whiten as whiten

LOG_RATIO_LIMIT = 20.0
"""Log importance ratios are clamped to +-20 before ``exp`` (e^20 ~ 4.9e8 keeps float32 finite)."""


def trainable(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: tokens that enter the loss."""
    return loss_mask > 0


def row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]``: sum of each row's masked-in entries."""
    return masked(x, mask).sum(dim=-1)


def row_count(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]`` float: masked-in entries per row."""
    return mask.sum(dim=-1).to(torch.float32)


def row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B]``: mean of each row's masked-in entries; 0 for an empty row."""
    return row_sum(x, mask) / row_count(mask).clamp(min=1.0).to(x.dtype)


def batch_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scalar mean of all masked-in entries; 0 when there are none."""
    return masked(x, mask).sum() / mask.sum().clamp(min=1).to(x.dtype)


def last_trainable_position(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T] -> ([B] long, [B] bool)``: each row's last masked-in column, and whether it has one."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    return last.clamp(min=0), last >= 0
