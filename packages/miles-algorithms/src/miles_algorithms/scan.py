"""Discounted reverse scans over the trainable tokens of each row.

Masked tokens (prompt, tool output, user turns, padding) are not steps of the decision process:
they carry no reward, no value and no discounting. So each row is first *compressed* to its
trainable tokens, in order, the scan runs on the compressed rows, and results are scattered back
(0 off-mask). A tool call that spans 300 masked tokens therefore costs one step of discount,
not 300.

The scan ``y[j] = x[j] + c * y[j + 1]`` runs in chunks of ``CHUNK`` steps: inside a chunk it is
one matrix product with the upper-triangular matrix of powers ``c**(k - j)``; chunks are chained
from the end through the carry ``c**(n - j) * y[next chunk start]``. Every power has a
non-negative exponent, so it stays in [0, 1] for ``c <= 1`` (a closed form with ``c**-k`` would
overflow long before 16K tokens), and a 16K-token row takes 128 Python iterations, not 16K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 128


@dataclass(frozen=True, slots=True)
class Compressed:
    """Trainable tokens of each row moved to the front, in order.

    :ivar order: ``[B, T]`` long, a permutation of each row's columns, trainable columns first.
    :ivar valid: ``[B, L]`` bool, compressed slot ``j`` of row ``b`` holds a trainable token.
    """

    order: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, mask: torch.Tensor) -> Compressed:
        """Compression plan of a ``[B, T]`` bool mask; ``L`` = most trainable tokens of a row."""
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
        counts = mask.sum(dim=-1, keepdim=True)
        width = int(counts.max().item()) if mask.numel() else 0
        valid = torch.arange(width, device=mask.device).expand(mask.shape[0], width) < counts
        return cls(order, valid)

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T] -> [B, L]``: trainable entries of ``x`` in order, 0 in empty slots."""
        picked = x.gather(-1, self.order[:, : self.valid.shape[-1]])
        return torch.where(self.valid, picked, torch.zeros_like(picked))

    def expand(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, L] -> [B, T]``: back to the original columns, 0 off-mask."""
        out = torch.zeros(y.shape[0], width, dtype=y.dtype, device=y.device)
        y = torch.where(self.valid, y, torch.zeros_like(y))
        return out.scatter(-1, self.order[:, : self.valid.shape[-1]], y)


def reverse_discounted_sum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``[B, L] -> [B, L]``: ``y[j] = sum_{k >= j} discount**(k - j) * x[k]`` along the last dim."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must lie in [0, 1], got {discount}")
    length = x.shape[-1]
    out = torch.empty_like(x)
    carry = torch.zeros_like(x[..., :1])
    for end in range(length, 0, -CHUNK):
        start = max(0, end - CHUNK)
        n = end - start
        steps = torch.arange(n, device=x.device)
        gap = steps[:, None] - steps[None, :]  # [n, n]: entry [k, j] = k - j
        base = torch.tensor(discount, dtype=x.dtype, device=x.device)
        powers = torch.where(gap >= 0, base ** gap.clamp(min=0), torch.zeros((), dtype=x.dtype, device=x.device))
        carry_powers = base ** (n - steps)  # [n]: discount**(n - j) reaches the next chunk's start
        chunk = x[..., start:end] @ powers + carry * carry_powers
        out[..., start:end] = chunk
        carry = chunk[..., :1]
    return out
