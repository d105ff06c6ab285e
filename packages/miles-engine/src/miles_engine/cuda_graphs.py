"""CUDA graphs for the decode step.

A decode step of a small model is a few hundred small kernels. Launched eagerly from Python (HF
modules, one layer after another) it took 47-57 ms on the H200 for SmolLM2-135M at any batch size
(``docs/benchmarks/engine-h200.json``), while the GPU work is a fraction of a millisecond: the step
was bound by launch latency and Python. A CUDA graph records the launches once and replays them
with one call.

Shapes are fixed per graph, so there is one graph per *(batch bucket, KV-length bucket)*, captured
the first time a step needs it:

- the batch is padded up to the next bucket (:func:`batch_buckets`). A pad row feeds token 0 at
  position 0 into a slot no running request uses (the runner reserves slots for the whole
  bucket), and its logits are dropped, so it changes nothing a request can see;
- attention reads the first ``L`` positions of every slot, ``L`` the next power of two of the
  longest row (at least 128, at most the cache's capacity); the mask hides what a row has not
  written.

Inputs (one token and one position per row) go into a static buffer; the mask and the cache
write indices are computed *inside* the graph from the positions, so a replay is one host-to-device
copy plus ``graph.replay()``.

What a graph remembers is addresses: of the weights (updates copy into the same tensors in place,
so graphs survive weight syncs) and of the KV cache (never released in this mode; when it grows
in slots or length, i.e. is reallocated, every graph is dropped and recaptured on demand: a few
times per engine life, as capacity doubles).

Capture runs the step eagerly first (warm-up, on a side stream, as CUDA requires), and that
warm-up *is* the real step: capturing mid-serving needs no dummy data. Replaying right after
recomputes the same keys and values into the same cache cells, so the result is unchanged.

Not used for MoE models whose routed experts are being recorded (the recording hooks run in
Python), nor on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from miles_engine.kv_cache import SlotKVCache

_MIN_LENGTH_BUCKET = 128


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 4 to 16, of 8 to 64, of 16 to 256,
    of 32 beyond; capped at (and always including) ``max_batch``. A padded row costs little (a
    decode step reads the weights once whatever the batch), so fewer graphs win over less padding."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        last = sizes[-1]
        sizes.append(last + (4 if last < 16 else 8 if last < 64 else 16 if last < 256 else 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_for(value: int, buckets: list[int]) -> int:
    for size in buckets:
        if size >= value:
            return size
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


def length_bucket(kv_len: int, capacity: int) -> int:
    """Positions a graph's attention reads: the next power of two of ``kv_len`` (at least 128),
    capped at the cache's capacity (which is at least ``kv_len``)."""
    bucket = _MIN_LENGTH_BUCKET
    while bucket < kv_len:
        bucket *= 2
    return min(bucket, capacity)


class GraphCaptureError(RuntimeError):
    """Capturing a decode step failed (an operation that cannot be captured, or out of memory)."""


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [batch bucket, V], written by every replay


class DecodeGraphs:
    """Captured decode steps of one model over one :class:`SlotKVCache`."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, max_batch: int) -> None:
        import torch

        self.model = model
        self.cache = cache
        self.buckets = batch_buckets(max_batch)
        self.device = cache.device
        # row 0: the token each row feeds; row 1: its position (= its current length)
        self.inputs = torch.zeros((2, max_batch), dtype=torch.long, device=self.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._cache_identity: tuple[int, int, int] | None = None
        self.captures = 0
        self.replays = 0

    def reset(self) -> None:
        """Forget every graph (the weights or the cache they captured moved); the next decode step
        captures anew."""
        self.graphs.clear()
        self._cache_identity = None

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for rows ``0 .. len(tokens)-1`` (row ``i`` in slot ``i``); returns the
        next-token logits ``[B, V]``. The cache must already hold ``max(positions) + 1`` positions
        and as many slots as the batch's bucket."""
        import torch

        batch = len(tokens)
        padded = bucket_for(batch, self.buckets)
        kv_len = length_bucket(max(positions) + 1, self.cache.length)
        assert self.cache.k is not None  # reserved by the scheduler before any decode step
        identity = (self.cache.k.data_ptr(), self.cache.slots, self.cache.length)
        if identity != self._cache_identity:  # the cache was reallocated: graphs point at the old one
            self.graphs.clear()
            # A new memory pool too: the old one may still hold live tensors (the last logits),
            # and PyTorch refuses to capture into a pool whose graphs are all gone.
            self.pool = torch.cuda.graph_pool_handle()
            self._cache_identity = identity
        pad = [0] * (padded - batch)
        host = torch.tensor([tokens + pad, positions + pad], dtype=torch.long)
        self.inputs[:, :padded].copy_(host)
        entry = self.graphs.get((padded, kv_len))
        if entry is None:
            try:
                entry = self._capture(padded, kv_len)
            except Exception as exc:
                raise GraphCaptureError(f"capturing the decode step (batch {padded}, KV length {kv_len}) failed: "
                                        f"{type(exc).__name__}: {exc}") from exc
            self.graphs[(padded, kv_len)] = entry
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:batch]

    def _step(self, batch: int, kv_len: int) -> torch.Tensor:
        import torch

        tokens = self.inputs[0, :batch, None]
        positions = self.inputs[1, :batch]
        self.cache.plan_decode(batch, positions, kv_len)
        # [B, 1, 1, kv_len]: row b sees its own positions 0 .. positions[b]
        mask = (torch.arange(kv_len, device=self.device)[None, :] <= positions[:, None])[:, None, None]
        out = self.model(input_ids=tokens, position_ids=positions[:, None], attention_mask=mask,
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _capture(self, batch: int, kv_len: int) -> _Graph:
        import torch

        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):  # library handles and workspaces are set up outside the capture
                self._step(batch, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(batch, kv_len)
        self.captures += 1
        return _Graph(graph, logits)
