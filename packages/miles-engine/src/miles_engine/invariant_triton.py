"""Triton kernels of the batch-invariant forward (true on-policy) for CUDA tensors.

:mod:`miles_engine.invariant` calls these for tensors on a GPU; the CPU keeps its row-by-row
PyTorch path. The contract is the same: a row's output bits depend only on that row's inputs,
never on how many rows share the call, where the row sits in it, padding, or prefill vs decode.
Each kernel gets that by construction:

* **One compiled configuration per layer.** Block sizes, warps and stages are module constants or
  follow only a row's own width (head size, hidden size: the same on both sides), never autotuned
  and never chosen from the number of rows, and the batch dimension is not specialised
  (``do_not_specialize``), so the engine's decode of one row, a CUDA graph's padded batch and the
  trainer's packed micro-batch run the same machine code.
* **No reduction across rows, no split of a row's reduction across programs.** A program owns
  whole output rows of a tile and walks the reduced dimension from its start in fixed-size
  blocks, in order: a matmul tile accumulates ``K`` in ``BLOCK_K`` steps (no split-K), RMSNorm
  and log-softmax reduce one row inside one program. Tensor-core ``dot`` computes each output
  element from its own row and column, so the rest of the tile cannot reach it.
* **Attention walks each query's own keys.** A query attends to a contiguous range of keys
  ``[lo, hi)`` (its causal prefix in the engine's slot, its own document in the trainer's packed
  row); the kernel starts its key blocks at ``lo``, whatever the key tensor's length or where the
  range sits in it, so the online softmax rescales at the same keys and sums the same blocks in
  every call. A program takes a tile of consecutive queries sharing ``lo`` (a prefill's or a
  document's queries; one query in a decode step): blocks past a query's last key are fully
  masked for it and leave its running maximum, sum and accumulator unchanged bit for bit (the
  rescale factor is ``exp(0) = 1`` and the added terms are zeros), and a masked key inside its
  last block contributes an exact zero, as in a decode step.

The backward passes are not part of the contract (only forward values must agree between engine
and trainer): they recompute the PyTorch reference of each op and differentiate that.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# One configuration per kernel (see the module docstring): never derived from a shape.
MATMUL_BLOCK_M, MATMUL_BLOCK_N, MATMUL_BLOCK_K, MATMUL_WARPS, MATMUL_STAGES = 64, 128, 64, 4, 3
ATTN_BLOCK_N, ATTN_WARPS = 32, 4
ATTN_ROWS = 64  # rows of an attention tile: queries x their group of heads (tl.dot needs >= 16)
NORM_WARPS = 4
LOGSOFTMAX_BLOCK, LOGSOFTMAX_WARPS = 4096, 8
_NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity" for the running maximum: exp(_NEG - m) is exactly 0


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias``, fp32 accumulation, output in ``x``'s dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul wants x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"matmul wants one dtype, got x {x.dtype} and weight {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n)
    if m == 0:
        return out
    grid = (triton.cdiv(m, MATMUL_BLOCK_M), triton.cdiv(n, MATMUL_BLOCK_N))
    _matmul_kernel[grid](x, weight, bias if bias is not None else x, out, m, n, k,
                         x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                         BLOCK_M=MATMUL_BLOCK_M, BLOCK_N=MATMUL_BLOCK_N, BLOCK_K=MATMUL_BLOCK_K,
                         num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES)
    return out


@triton.jit(do_not_specialize=["Q"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, tile_first_ptr, tile_count_ptr, out_ptr, Q, scale,
                      sq_b, sq_h, sq_q, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                      so_b, so_q, so_h, so_d,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr):
    """One program: a tile of consecutive queries of one batch row that share their first key
    ``lo``, times the ``GROUP`` query heads of KV head ``g`` (row ``r`` = query ``r // GROUP``,
    head ``r % GROUP``). Every query walks the key blocks from ``lo``; blocks past its own last key
    are fully masked for it, which leaves its running state unchanged bit for bit."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    first = tl.load(tile_first_ptr + t)
    count = tl.load(tile_count_ptr + t)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = r < count * GROUP
    flat = first + r // GROUP  # the query's index in [batch * Q]
    b = first // Q
    i = flat % Q
    heads = g * GROUP + r % GROUP
    lo = tl.load(lo_ptr + first)
    hi = tl.load(hi_ptr + flat, mask=live, other=0)
    last = tl.max(hi, 0)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + i[:, None] * sq_q + d[None, :] * sq_d, mask=live[:, None],
                other=0.0)
    m = tl.full((ROWS,), _NEG, dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    for start in range(lo, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        present = n < last
        k = tl.load(k_ptr + b * sk_b + g * sk_h + n[None, :] * sk_l + d[:, None] * sk_d, mask=present[None, :],
                    other=0.0)
        if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(n[None, :] < hi[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * sv_b + g * sv_h + n[:, None] * sv_l + d[None, :] * sv_d, mask=present[:, None],
                    other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row with no keys (a pad row) stays 0
    tl.store(out_ptr + b * so_b + i[:, None] * so_q + heads[:, None] * so_h + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=live[:, None])


# The key ranges of the last mask seen (a forward passes the same mask to every layer), per thread:
# an engine and a trainer may share a process.
_last_ranges = threading.local()


def key_ranges(mask: torch.Tensor | None, batch: int, queries: int, length: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's admitted keys as ``[lo, hi)`` (int32 ``[batch * queries]`` each).

    ``mask`` is boolean ``[B or 1, 1, Q, L]`` (True = attend) or None (causal: the queries are the
    last ``Q`` of ``L`` positions). The admitted keys of a query must be contiguous; for the
    trainer's masks that is checked (once per mask object and version) and a mask that breaks it is
    refused."""
    if mask is None:
        hi = torch.arange(length - queries + 1, length + 1, device=device, dtype=torch.int32).repeat(batch)
        return torch.zeros_like(hi), hi
    # Inference tensors (the engine's masks, built as causal prefixes in runner.py and cuda_graphs.py)
    # keep no version counter, so a cached answer could be stale: computed every time, not checked
    # (the check synchronises, and a CUDA graph cannot hold it).
    checked = not mask.is_inference() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    key = (mask._version, batch, queries, length) if checked else None
    if checked:
        last = getattr(_last_ranges, "entry", None)
        if last is not None and last[0]() is mask and last[1] == key:
            return last[2]
    rows = mask[:, 0].expand(batch, queries, length).reshape(batch * queries, length)
    as_int = rows.to(torch.int8)
    count = as_int.sum(-1, dtype=torch.int32)
    lo = as_int.argmax(-1).to(torch.int32)  # the first admitted key (argmax returns the first maximum)
    hi = (length - as_int.flip(-1).argmax(-1)).to(torch.int32)
    lo = torch.where(count > 0, lo, 0)
    hi = torch.where(count > 0, hi, 0)
    if checked:
        if not bool((hi - lo == count).all()):
            raise ValueError("true on-policy attention needs each query's admitted keys to be one contiguous range "
                             "(a causal prefix, or a packed document)")
        _last_ranges.entry = (weakref.ref(mask), key, (lo, hi))
    return lo, hi


_last_tiles = threading.local()


def query_tiles(lo: torch.Tensor, batch: int, queries: int, per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the ``batch * queries`` queries into tiles of at most ``per_tile`` consecutive queries
    of one batch row with the same first key ``lo``: ``(first, count)`` int32 per tile. A decode
    step (one query per row) gets one tile per row without a host synchronisation (CUDA graphs)."""
    total = batch * queries
    device = lo.device
    if queries == 1 or per_tile == 1:
        return torch.arange(total, device=device, dtype=torch.int32), torch.ones(total, device=device, dtype=torch.int32)
    last = getattr(_last_tiles, "entry", None)
    if last is not None and last[0]() is lo and last[1] == (batch, queries, per_tile):
        return last[2]
    index = torch.arange(total, device=device)
    segment_starts = index % queries == 0
    segment_starts[1:] |= lo[1:] != lo[:-1]
    segment_first = torch.cummax(torch.where(segment_starts, index, 0), 0).values
    starts = segment_starts | ((index - segment_first) % per_tile == 0)
    first = starts.nonzero()[:, 0]
    count = torch.diff(first, append=first.new_tensor([total]))
    tiles = first.to(torch.int32), count.to(torch.int32)
    _last_tiles.entry = (weakref.ref(lo), (batch, queries, per_tile), tiles)
    return tiles


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """transformers' layout: ``query [B, H, Q, D]``, ``key``/``value`` ``[B, KV, L, D]``; returns
    ``[B, Q, H, D]``."""
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the invariant attention kernel needs a power-of-two head_dim >= 16, got {dim}")
    group = heads // kv_heads
    if group > ATTN_ROWS:
        raise ValueError(f"the invariant attention kernel takes at most {ATTN_ROWS} query heads per KV head, got {group}")
    lo, hi = key_ranges(mask, batch, queries, length, query.device)
    out = query.new_empty(batch, queries, heads, dim)
    if out.numel() == 0:
        return out
    first, count = query_tiles(lo, batch, queries, ATTN_ROWS // group)
    grid = (first.shape[0], kv_heads)
    _attention_kernel[grid](query, key, value, lo, hi, first, count, out, queries, scale, *query.stride(),
                            *key.stride(), *value.stride(), *out.stride(), GROUP=group, ROWS=ATTN_ROWS, D=dim,
                            BLOCK_N=ATTN_BLOCK_N, IEEE=query.dtype == torch.float32, num_warps=ATTN_WARPS)
    return out


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """PyTorch's SDPA over the same admitted keys (the backward differentiates this)."""
    import torch.nn.functional as F

    batch, heads, queries, _ = query.shape
    length = key.shape[2]
    lo, hi = key_ranges(mask, batch, queries, length, query.device)
    cols = torch.arange(length, device=query.device)
    allowed = (cols >= lo[:, None]) & (cols < hi[:, None])
    allowed = allowed.reshape(batch, 1, queries, length)
    group = heads // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(1, 2)


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, H, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / H
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, statistics in
    fp32), each row reduced inside one program."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(flat.shape, dtype=dtype, device=x.device)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](flat, weight, out, flat.shape[0], shape[-1], eps, flat.stride(0),
                                           out.stride(0), BLOCK=triton.next_power_of_2(shape[-1]),
                                           num_warps=NORM_WARPS)
    return out.reshape(shape)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit(do_not_specialize=["rows"])
def _log_softmax_kernel(x_ptr, out_ptr, rows, V, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < V, other=float("-inf"))
        top = tl.maximum(top, x.to(tl.float32))
    biggest = tl.max(top, 0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < V, other=float("-inf"))
        total += tl.exp(x.to(tl.float32) - biggest)
    log_total = tl.log(tl.sum(total, 0))
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * stride_o + start + cols, x.to(tl.float32) - biggest - log_total, mask=inside)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax`` over the last dimension of ``[R, V]``, one program per row walking the
    vocabulary in fixed blocks (a maximum, a sum of ``exp`` per lane, then one tree sum)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=x.device)
    if flat.shape[0]:
        _log_softmax_kernel[(flat.shape[0],)](flat, out, flat.shape[0], flat.shape[1], flat.stride(0), out.stride(0),
                                              BLOCK=LOGSOFTMAX_BLOCK, num_warps=LOGSOFTMAX_WARPS)
    return out.reshape(x.shape)


class _ForwardFromKernel(torch.autograd.Function):
    """The kernel's output forward, the PyTorch reference's gradient backward (recomputed)."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                extra: tuple[Any, ...], *tensors: torch.Tensor) -> torch.Tensor:
        ctx.reference = reference
        ctx.extra = extra
        ctx.save_for_backward(*tensors)
        return kernel(*tensors, *extra)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wants = ctx.needs_input_grad[3:]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, wants, strict=True)]
        with torch.enable_grad():
            out = ctx.reference(*inputs, *ctx.extra)
        needed = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, needed, grad, allow_unused=True)) if needed else iter(())
        return (None, None, None, *(next(grads) if t.requires_grad else None for t in inputs))


def _differentiable(kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                    tensors: tuple[torch.Tensor | None, ...], extra: tuple[Any, ...]) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _ForwardFromKernel.apply(kernel, reference, extra, *tensors)
    return kernel(*tensors, *extra)


def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """:func:`attention`, differentiable (the mask travels as an extra argument, not a tensor input)."""
    return _differentiable(attention, reference_attention, (query, key, value), (mask, scale))


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _differentiable(rms_norm, reference_rms_norm, (x, weight), (eps,))


def log_softmax_op(x: torch.Tensor) -> torch.Tensor:
    return _differentiable(log_softmax, lambda t: torch.log_softmax(t.float(), dim=-1), (x,), ())
