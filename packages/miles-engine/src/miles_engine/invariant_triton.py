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
and trainer), so their tiles are free; they are kernels too because the trainer's step is bound by
launches and Python at these model sizes (a recomputed PyTorch reference differentiated by autograd
cost ~20 launches per RMSNorm and a dense-mask SDPA per attention layer). Attention's is
flash-attention's: the forward also stores each row's log-sum-exp, one kernel accumulates dK and dV
per key block, another dQ per query tile, every (query, key) pair masked by the query's own range.
RMSNorm's computes dX per row and dW from per-block partial sums. The log-softmax's backward
differentiates PyTorch's (a few calls per step, on the loss's chunks).
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
def _attention_kernel(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, tile_first_ptr, tile_count_ptr, out_ptr, lse_ptr, Q, H,
                      scale,
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
    # the log-sum-exp of the scaled scores, for the backward (0 for a row without keys, whose every
    # probability the backward masks to 0); stored after the output, whose value it cannot change
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), 0.0)
    tl.store(lse_ptr + flat * H + heads, lse, mask=live)


# The key ranges of the last mask seen (a forward passes the same mask to every layer), per thread:
# an engine and a trainer may share a process.
_last_ranges = threading.local()


def key_ranges(mask: torch.Tensor | None, batch: int, queries: int, length: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's admitted keys as ``[lo, hi)`` (int32 ``[batch * queries]`` each).

    ``mask`` is boolean ``[B or 1, 1, Q, L]`` (True = attend) or None (causal: the queries are the
    last ``Q`` of ``L`` positions). The admitted keys of a query must be contiguous; for the
    trainer's masks that is checked (once per mask object and version) and a mask that breaks it is
    refused. Each thread keeps the last mask's answer (an engine and a trainer may share a process)."""
    if mask is None:
        hi = torch.arange(length - queries + 1, length + 1, device=device, dtype=torch.int32).repeat(batch)
        return torch.zeros_like(hi), hi
    # A forward passes one mask object to every layer, so the ranges are computed by its first layer
    # and reused by the rest (and by the backward). The trainer's masks are checked for holes (a host
    # synchronisation) and cached per object and version. The engine's are inference tensors, built
    # afresh for each forward and never written afterwards (runner.py, cuda_graphs.py); they keep no
    # version counter, so they are cached per object only, and not checked: the check synchronises,
    # which a CUDA graph cannot hold (inside a capture, the layers after the first read the ranges
    # the first one's captured kernels compute).
    checked = not mask.is_inference() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    key = (mask._version if checked else None, batch, queries, length)
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
    if checked and not bool((hi - lo == count).all()):
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
    last = getattr(_last_tiles, "entry", None)
    if last is not None and last[0]() is lo and last[1] == (batch, queries, per_tile):
        return last[2]  # the same forward's next layer (``lo`` is cached per mask, see key_ranges)
    if queries == 1 or per_tile == 1:
        tiles = torch.arange(total, device=device, dtype=torch.int32), torch.ones(total, device=device, dtype=torch.int32)
        _last_tiles.entry = (weakref.ref(lo), (batch, queries, per_tile), tiles)
        return tiles
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


def _attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The kernel's output ``[B, Q, H, D]``, the log-sum-exp of each (query, head) row ``[B * Q, H]``
    (fp32) and what the backward needs again: ``(lo, hi, first, count)``."""
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the invariant attention kernel needs a power-of-two head_dim >= 16, got {dim}")
    group = heads // kv_heads
    if group > ATTN_ROWS:
        raise ValueError(f"the invariant attention kernel takes at most {ATTN_ROWS} query heads per KV head, got {group}")
    lo, hi = key_ranges(mask, batch, queries, length, query.device)
    out = query.new_empty(batch, queries, heads, dim)
    lse = torch.empty(batch * queries, heads, device=query.device, dtype=torch.float32)
    first, count = query_tiles(lo, batch, queries, ATTN_ROWS // group)
    if out.numel():
        _attention_kernel[(first.shape[0], kv_heads)](
            query, key, value, lo, hi, first, count, out, lse, queries, heads, scale, *query.stride(), *key.stride(),
            *value.stride(), *out.stride(), GROUP=group, ROWS=ATTN_ROWS, D=dim, BLOCK_N=ATTN_BLOCK_N,
            IEEE=query.dtype == torch.float32, num_warps=ATTN_WARPS)
    return out, lse, (lo, hi, first, count)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """transformers' layout: ``query [B, H, Q, D]``, ``key``/``value`` ``[B, KV, L, D]``; returns
    ``[B, Q, H, D]``."""
    return _attention_forward(query, key, value, mask, scale)[0]


# The backward (flash-attention's recomputation: probabilities from the saved log-sum-exp). Its
# numbers are not part of the contract, so its tiles are free; it masks each (query, key) pair by
# the query's own range, like the forward.
BWD_BLOCK_N, BWD_ROWS, BWD_WARPS = 32, 64, 4


@triton.jit
def _attention_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, lo_ptr, hi_ptr, dk_ptr, dv_ptr, Q, L, H,
                           scale, sq_b, sq_h, sq_q, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                           sdo_b, sdo_q, sdo_h, sdo_d, sg_b, sg_h, sg_l, sg_d,
                           GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr):
    """One program: a block of ``BLOCK_N`` keys of KV head ``g`` in batch row ``b``; it visits the
    row's queries in tiles of ``ROWS // GROUP`` (times their ``GROUP`` heads), skipping the tiles
    whose ranges miss the block, and accumulates the block's dK and dV."""
    nb = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    r = tl.arange(0, ROWS)
    inside = n < L
    k = tl.load(k_ptr + b * sk_b + g * sk_h + n[None, :] * sk_l + d[:, None] * sk_d, mask=inside[None, :], other=0.0)
    v = tl.load(v_ptr + b * sv_b + g * sv_h + n[None, :] * sv_l + d[:, None] * sv_d, mask=inside[None, :], other=0.0)
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    per_tile = ROWS // GROUP
    for q0 in range(0, Q, per_tile):
        i = q0 + r // GROUP
        live = (r < per_tile * GROUP) & (i < Q)
        flat = b * Q + i
        lo = tl.load(lo_ptr + flat, mask=live, other=0)
        hi = tl.load(hi_ptr + flat, mask=live, other=0)
        if (tl.max(hi, 0) > nb * BLOCK_N) & (tl.min(tl.where(live, lo, L), 0) < nb * BLOCK_N + BLOCK_N):
            heads = g * GROUP + r % GROUP
            q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + i[:, None] * sq_q + d[None, :] * sq_d,
                        mask=live[:, None], other=0.0)
            do = tl.load(do_ptr + b * sdo_b + i[:, None] * sdo_q + heads[:, None] * sdo_h + d[None, :] * sdo_d,
                         mask=live[:, None], other=0.0)
            lse = tl.load(lse_ptr + flat * H + heads, mask=live, other=0.0)
            delta = tl.load(delta_ptr + flat * H + heads, mask=live, other=0.0)
            admitted = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None]) & live[:, None]
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
                dp = tl.dot(do, v, input_precision="ieee")
            else:
                s = tl.dot(q, k)
                dp = tl.dot(do, v)
            p = tl.where(admitted, tl.exp(s * scale - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if IEEE:
                dv += tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
                dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    out = b * sg_b + g * sg_h + n[:, None] * sg_l + d[None, :] * sg_d  # dK and dV: fresh, one layout
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=inside[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=inside[:, None])


@triton.jit
def _attention_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, lo_ptr, hi_ptr, tile_first_ptr,
                         tile_count_ptr, dq_ptr, Q, H, scale, sq_b, sq_h, sq_q, sq_d, sk_b, sk_h, sk_l, sk_d,
                         sv_b, sv_h, sv_l, sv_d, sdo_b, sdo_q, sdo_h, sdo_d, sg_b, sg_h, sg_q, sg_d,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    """One program: the forward's tile of queries (sharing ``lo``) times the ``GROUP`` heads of KV
    head ``g``, walking the key blocks of its range; dQ has ``query``'s layout."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    first = tl.load(tile_first_ptr + t)
    count = tl.load(tile_count_ptr + t)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    live = r < count * GROUP
    flat = first + r // GROUP
    b = first // Q
    i = flat % Q
    heads = g * GROUP + r % GROUP
    lo = tl.load(lo_ptr + first)
    hi = tl.load(hi_ptr + flat, mask=live, other=0)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + i[:, None] * sq_q + d[None, :] * sq_d, mask=live[:, None],
                other=0.0)
    do = tl.load(do_ptr + b * sdo_b + i[:, None] * sdo_q + heads[:, None] * sdo_h + d[None, :] * sdo_d,
                 mask=live[:, None], other=0.0)
    lse = tl.load(lse_ptr + flat * H + heads, mask=live, other=0.0)
    delta = tl.load(delta_ptr + flat * H + heads, mask=live, other=0.0)
    dq = tl.zeros((ROWS, D), dtype=tl.float32)
    last = tl.max(hi, 0)
    for start in range(lo, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        present = n < last
        admitted = (n[None, :] < hi[:, None]) & live[:, None]
        k = tl.load(k_ptr + b * sk_b + g * sk_h + n[:, None] * sk_l + d[None, :] * sk_d, mask=present[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + g * sv_h + n[None, :] * sv_l + d[:, None] * sv_d, mask=present[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, v, input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, v)
        p = tl.where(admitted, tl.exp(s * scale - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, k.to(tl.float32), input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + b * sg_b + heads[:, None] * sg_h + i[:, None] * sg_q + d[None, :] * sg_d,
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=live[:, None])


def attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, ranges: tuple[torch.Tensor, ...],
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of :func:`attention` from the output's gradient ``grad [B, Q, H, D]`` and what the
    forward kept (its output, log-sum-exp and key ranges); grouped query heads sum into their KV head."""
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    lo, hi, first, count = ranges
    grad = grad.to(query.dtype)
    delta = (grad.float() * out.float()).sum(-1).reshape(batch * queries, heads)  # rowsum(dO * O)
    if not query.numel() or not key.numel():
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    # every element is written: dK/dV by the key blocks, dQ by the tiles, which cover every query
    dq = torch.empty(batch, heads, queries, dim, device=query.device, dtype=query.dtype)
    dk = torch.empty(batch, kv_heads, length, dim, device=key.device, dtype=key.dtype)
    dv = torch.empty(batch, kv_heads, length, dim, device=value.device, dtype=value.dtype)
    ieee = query.dtype == torch.float32
    _attention_dkdv_kernel[(triton.cdiv(length, BWD_BLOCK_N), kv_heads, batch)](
        query, key, value, grad, lse, delta, lo, hi, dk, dv, queries, length, heads, scale, *query.stride(),
        *key.stride(), *value.stride(), *grad.stride(), *dk.stride(), GROUP=group, ROWS=BWD_ROWS, D=dim,
        BLOCK_N=BWD_BLOCK_N,
        IEEE=ieee, num_warps=BWD_WARPS)
    _attention_dq_kernel[(first.shape[0], kv_heads)](
        query, key, value, grad, lse, delta, lo, hi, first, count, dq, queries, heads, scale, *query.stride(),
        *key.stride(), *value.stride(), *grad.stride(), *dq.stride(), GROUP=group, ROWS=ATTN_ROWS, D=dim, BLOCK_N=BWD_BLOCK_N,
        IEEE=ieee, num_warps=BWD_WARPS)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """The kernel's output forward; the backward kernels above from its saved log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        out, lse, ranges = _attention_forward(query, key, value, mask, scale)
        ctx.save_for_backward(query, key, value, out, lse, *ranges)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, *ranges = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad, query, key, value, out, lse, tuple(ranges), ctx.scale)
        return dq, dk, dv, None, None


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """PyTorch's SDPA over the same admitted keys: what the tests hold the kernels (forward and
    backward) against."""
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


NORM_BWD_ROWS = 32  # rows per program of the RMSNorm backward (each writes one partial sum of dW)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, rows, H, eps, stride_x, stride_dy, stride_dx,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """dX of ``ROWS`` rows and their partial dW (row ``program_id`` of ``dw_ptr``): with ``n`` the
    normalised row and ``r`` its reciprocal RMS, ``dn = dy * w`` and ``dx = r * (dn - n * mean(dn * n))``;
    ``dw`` sums ``dy * n`` (``n`` cast to the input's dtype, as the forward multiplies it)."""
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(ROWS):
        row = block * ROWS + j
        if row < rows:
            x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
            xf = x.to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
            n = xf * r
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
            dw += dy * n.to(x.dtype).to(tl.float32)
            dn = dy * w
            dx = r * (dn - n * (tl.sum(dn * n, 0) / H))
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dw_ptr + block * H + cols, dw, mask=inside)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dX and dW of :func:`rms_norm` (fp32 inside; dW summed over the row blocks' partial sums)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    dy = grad.reshape(-1, shape[-1])
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    rows = flat.shape[0]
    dx = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(rows, NORM_BWD_ROWS)
    partial = torch.empty(blocks, shape[-1], dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_backward_kernel[(blocks,)](flat, weight, dy, dx, partial, rows, shape[-1], eps, flat.stride(0),
                                             dy.stride(0), dx.stride(0), ROWS=NORM_BWD_ROWS,
                                             BLOCK=triton.next_power_of_2(shape[-1]), num_warps=NORM_WARPS)
    return dx.reshape(shape), partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(grad, x, weight, ctx.eps)
        return dx, dw, None


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
    """:func:`attention`, differentiable through :func:`attention_backward`."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _Attention.apply(query, key, value, mask, scale)
    return attention(query, key, value, mask, scale)


def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm`, differentiable through :func:`rms_norm_backward`."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm(x, weight, eps)


def log_softmax_op(x: torch.Tensor) -> torch.Tensor:
    return _differentiable(log_softmax, lambda t: torch.log_softmax(t.float(), dim=-1), (x,), ())
