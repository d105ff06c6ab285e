"""Masked tensor helpers shared by every module.

Off-mask entries of per-token inputs can hold anything (padding, tool tokens, engine garbage).
They are replaced by a constant with ``torch.where`` *before* any arithmetic, never multiplied by
the mask: ``nan * 0`` is nan, and ``exp`` of a masked 1e4 would poison the backward pass even
where the forward result is discarded.
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0
"""Log importance ratios are clamped to +-20 before ``exp`` (e^20 ~ 4.9e8 keeps float32 finite)."""


def trainable(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: tokens that enter the loss."""
    return loss_mask > 0


def masked(x: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``x`` where ``mask``, ``fill`` elsewhere (gradient flows only through masked-in entries)."""
    return torch.where(mask, x, torch.full_like(x, fill))


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


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``[B, T]``: (x - mean) / (std + eps) over masked-in entries, 0 off-mask.

    Statistics in float64 so rewards of 1e6 and sums over millions of tokens stay exact enough.
    """
    x64 = masked(x.double(), mask)
    count = mask.sum().clamp(min=1).double()
    mean = x64.sum() / count
    var = masked((x64 - mean) ** 2, mask).sum() / count
    out = (x64 - mean) / (var.sqrt() + eps)
    return masked(out, mask).to(x.dtype)


def last_trainable_position(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T] -> ([B] long, [B] bool)``: each row's last masked-in column, and whether it has one."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    return last.clamp(min=0), last >= 0
