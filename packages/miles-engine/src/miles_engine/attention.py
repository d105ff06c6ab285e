"""Decode attention for CPU engines, registered with transformers as ``miles_cpu``.

A decode step has one query per request. PyTorch's CPU SDPA (its flash kernel) spends ~0.6 ms per
layer on that shape for a batch of 32 (a fifth of the step on SmolLM2), although the work is two
tiny batched matmuls. So for ``q == 1`` the engine computes it directly, grouping the query heads
that share a KV head (GQA) instead of repeating keys and values:

    scores [B, kv_heads, group, L] = q [B, kv_heads, group, D] @ k^T [B, kv_heads, D, L]

Prefill (``q > 1``) goes to transformers' own SDPA path. The mask is the engine's boolean
``[B, 1, q, L]`` (True = attend). Output layout is transformers': ``[B, q, heads, D]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

NAME = "miles_cpu"


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    if q_len != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # query head h uses KV head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)  # [B, kv_heads, group, L]
    scores.masked_fill_(~attention_mask, float("-inf"))  # mask [B, 1, 1, L] broadcasts
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, kv_heads, group, D]
    return out.reshape(batch, 1, heads, dim), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, decode_attention)
    return NAME
