"""Core attention of the local layers: PyTorch scaled-dot-product attention over packed sequences.

Inputs are megatron-core's packed (THD) layout: ``[t, heads, head_dim]`` with ``cu_seqlens``
giving where each sequence starts. Each sequence attends causally to itself only; nothing is
padded to a common length.

Context parallelism splits every sequence into ``2 * cp`` equal chunks and gives rank ``r`` chunks
``r`` and ``2 * cp - 1 - r`` (the load-balanced order megatron-core's rotary embedding and
Transformer Engine use). Keys and values are all-gathered over the context-parallel group (their
gradients reduce-scattered back), and each local query chunk attends to the keys up to its own
end with a causal mask aligned to the bottom right: query ``i`` of chunk ``c`` sees key ``j`` iff
``j <= c * chunk + i``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from miles_megatron import rope


class _GatherChunks(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums the gradients and keeps this rank's part."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if grad.is_cuda:
            out = torch.empty_like(grad.chunk(size)[rank])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo: no reduce-scatter on every torch version
        return grad.chunk(size)[rank].contiguous(), None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float) -> torch.Tensor:
    """``q: [h, lq, d]`` against ``k, v: [g, lk, d]`` (``lk >= lq``), causal with the diagonal at the
    bottom right (the queries are the last ``lq`` positions of the keys' span).

    The inputs get a batch dimension of 1: PyTorch's fused kernels (flash, memory-efficient) take
    4-D tensors only, and 3-D ones silently go to the math kernel, which materialises the
    ``[h, lq, lk]`` score matrix per layer (it ran a 16K-token row out of the H200's 140 GB).
    """
    lq, lk = q.shape[1], k.shape[1]
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if lq == lk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), scale=scale,
                                             dropout_p=dropout, enable_gqa=True)
    return out.squeeze(0)


@functools.cache
def _varlen_keywords() -> frozenset[str] | None:
    """The parameters of the installed ``varlen_attn`` (read once), None without the module."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_problem() -> str | None:
    """Why one-call packed attention (``torch.nn.attention.varlen``, CUDA only) cannot run here, or ``None``."""
    keywords = _varlen_keywords()
    if keywords is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (it arrived in 2.10)"
    if not torch.cuda.is_available():
        return "torch.nn.attention.varlen runs flash attention kernels on CUDA only"
    if "window_size" not in keywords and "is_causal" not in keywords:
        return f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal"
    return None


def _varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                   scale: float) -> torch.Tensor:
    """Causal attention of every packed sequence in one kernel call: ``q [t, h, d]``, ``k, v [t, g, d]``,
    ``cu [rows + 1]`` int32 starts. The keywords follow the installed torch: the API changed in
    2.10 -> 2.11 -> 2.12 (``is_causal`` became ``window_size``; ``scale`` and ``enable_gqa`` were added)."""
    from torch.nn.attention.varlen import varlen_attn

    keywords = _varlen_keywords() or frozenset()
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in keywords else {"is_causal": True}
    heads, groups = q.shape[1], k.shape[1]
    if heads != groups:
        if "enable_gqa" in keywords:
            kwargs["enable_gqa"] = True
        else:  # each key/value head serves heads // groups query heads, next to each other
            k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    if "scale" in keywords:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(d)
        q = q * (scale * math.sqrt(q.shape[-1]))
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)
    assert isinstance(out, torch.Tensor)  # a tuple only with return_aux, which is not asked for
    return out


class TorchAttention(MegatronModule):
    """Drop-in for megatron-core's ``core_attention`` (same constructor and forward signature)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        from megatron.core import parallel_state

        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        # set by miles_megatron.rope.defer: rotary embedding applied here from the inputs' positions
        self.apply_rope: Any = None
        # megatron.attention_kernel: varlen (one kernel call per layer for all sequences)
        self.varlen = False
        # the context PyTorch's attention runs in (megatron.sdpa_backends); set by build_chunks.
        # Entered here, in forward, so a recomputed forward picks the same kernel as the first
        self.sdpa: Any = contextlib.nullcontext

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("TorchAttention takes packed (THD) sequences; build inputs with miles_megatron.inputs")
        if attention_bias is not None:
            raise ValueError("TorchAttention does not take an attention bias")
        if self.apply_rope is not None:
            cos, sin = rope.tables(packed_seq_params, query.dtype)
            query, key = self.apply_rope(query, cos, sin), self.apply_rope(key, cos, sin)
        return self._packed(query, key, value, packed_seq_params)

    @torch.compiler.disable
    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
        """Attention of every packed sequence to itself: ``[t, heads * d]``. Never traced by
        ``torch.compile`` (compiled layers run it eagerly): it cuts tensors by host sequence lengths,
        which a trace would specialise on, one recompilation per new set of lengths."""
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        bounds = getattr(packed_seq_params, "bounds", None)
        if bounds is None:
            bounds = cu.tolist()  # a device sync per layer: MicroInputs gives them from the host
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        dropout = self.dropout if self.training else 0.0
        if self.varlen and cp == 1 and dropout == 0.0:
            return _varlen_causal(query, key, value, cu, max(lengths), self.scale).reshape(query.shape[0], -1)
        # [t, heads, d] -> [heads, t, d]: one sequence is then a slice along dim 1
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        with self.sdpa():
            if cp == 1:
                # split, not slices: a slice's backward is a zero-filled full-size gradient per sequence
                # (then summed), a split's is one concatenation
                pieces = zip(*(x.split(lengths, dim=1) for x in (q, k, v)), strict=True)
                out = [_attend(qs, ks, vs, self.scale, dropout) for qs, ks, vs in pieces]
            else:
                out = self._context_parallel(q, k, v, lengths, cp, dropout)
        # back to [t, heads, d] in one copy (each piece is a [heads, len, d] view of a [len, heads, d] output)
        return torch.cat([o.transpose(0, 1) for o in out], dim=0).reshape(query.shape[0], -1)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                          cp: int, dropout: float) -> list[torch.Tensor]:
        rank = dist.get_rank(self.cp_group)
        # [cp * t_local, g, d]: rank j's local tokens (its two chunks of every sequence) in block j
        keys = _GatherChunks.apply(k.transpose(0, 1), self.cp_group).transpose(0, 1)
        values = _GatherChunks.apply(v.transpose(0, 1), self.cp_group).transpose(0, 1)
        local = sum(lengths) // cp
        out, start = [], 0
        for length in lengths:
            chunk = length // (2 * cp)
            # chunk c of this sequence, read from the rank that holds it
            def chunk_of(t: torch.Tensor, c: int, start: int = start, chunk: int = chunk) -> torch.Tensor:
                owner, half = (c, 0) if c < cp else (2 * cp - 1 - c, 1)
                begin = owner * local + start + half * chunk
                return t[:, begin : begin + chunk]

            full_k = torch.cat([chunk_of(keys, c) for c in range(2 * cp)], dim=1)
            full_v = torch.cat([chunk_of(values, c) for c in range(2 * cp)], dim=1)
            for half, c in enumerate((rank, 2 * cp - 1 - rank)):
                mine = q[:, start + half * chunk : start + (half + 1) * chunk]
                end = (c + 1) * chunk
                out.append(_attend(mine, full_k[:, :end], full_v[:, :end], self.scale, dropout))
            start += 2 * chunk
        return out
