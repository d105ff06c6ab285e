"""Decode attention for CPU engines, registered with transformers as ``miles_cpu``.

A decode step has one query per request. PyTorch's CPU SDPA (its flash kernel) spends ~0.6 ms per
layer on that shape for a batch of 32 (a fifth of the step on SmolLM2), although the work is two
tiny batched matmuls. So for ``q == 1`` the engine computes it directly, grouping the query heads
that share a KV head (GQA) instead of repeating keys and values:

    scores [B, kv_heads, group, L] = q [B, kv_heads, group, D] @ k^T [B, kv_heads, D, L]

Prefill (``q > 1``) goes to transformers' own SDPA path. The mask is the engine's boolean
``[B, 1, q, L]`` (True = attend). Output layout is transformers': ``[B, q, heads, D]``.

A batched step attends every row over the batch's longest context (the rest masked), so a row's
sums are blocked differently as other requests come and go, and its output moves in the last
bits. ``miles_cpu_per_row`` (deterministic engines) computes each row over exactly its own
context instead: the same request gives the same bits in any batch, at the cost of a Python loop
over the rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

NAME = "miles_cpu"
PER_ROW_NAME = "miles_cpu_per_row"


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _grouped(query, key, value, attention_mask, scaling), None


def decode_attention_per_row(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """:func:`decode_attention` with each row over its own context only (batch-invariant)."""
    import torch

    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        return decode_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    lengths = attention_mask[:, 0, 0].sum(dim=-1).tolist()  # decode masks are a prefix of True per row
    rows = [_grouped(query[b : b + 1], key[b : b + 1, :, :n], value[b : b + 1, :, :n], None, scaling)
            for b, n in enumerate(lengths)]
    return torch.cat(rows), None


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
             scaling: float | None) -> torch.Tensor:
    """One query per row, GQA heads grouped; ``mask`` ``[B, 1, 1, L]`` (None: attend to all)."""
    import torch

    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # query head h uses KV head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # [B, kv_heads, group, L]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))  # mask [B, 1, 1, L] broadcasts
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, kv_heads, group, D]
    return out.reshape(batch, 1, heads, dim)


def register(*, per_row: bool = False) -> str:
    """Register both variants with transformers; returns the name of the one to load."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, decode_attention)
    AttentionInterface.register(PER_ROW_NAME, decode_attention_per_row)
    return PER_ROW_NAME if per_row else NAME
