"""The radix prefix cache: KV of finished (and prefilled) token prefixes, reused by later requests.

The running batch keeps its dense layout (:mod:`miles_engine.kv_cache`: one slot per request, no
page table, decode CUDA graphs bound to its address). Cached prefixes live beside it, in a pool of
token rows ``[layers, kv_heads, rows, head_dim]`` indexed by a :class:`~miles_engine.radix_tree.RadixTree`:

- **admission**: the longest cached prefix of a request (all but its last token, which must be fed
  to get logits) is copied from the pool into the request's slot, and only the rest is prefilled.
  A copy costs memory bandwidth (SmolLM2-135M, bf16: 23 KB a token, ~0.1 ms for a 10K-token history
  on an H200), far less than recomputing it;
- **after a prefill** the request's prompt is stored (only the part the tree lacks is copied), so
  requests that arrive while it runs share it; **when it finishes** (stop or length) its whole
  sequence is stored: the next turn of a conversation finds the previous turn's answer cached.
  A retracted request stores what it has, so it resumes nearly without prefilling;
- a request **holds** the tree node of what it stored or was given, so a prefix a running request
  builds on is never evicted; it lets go when it leaves the batch (finished, aborted, retracted).
  Rows are evicted least recently used, unpinned leaves first, when the pool is full
  (``max_tokens``); the pool grows by doubling up to that bound, so an engine that never sees a
  shared prefix allocates little;
- **one weight version per entry**: any change of the weights (:meth:`invalidate`, from
  ``ModelRunner.weights_changed``, which every weight update calls) drops the whole tree and bumps
  an epoch. A request records the epoch its KV was computed in; one whose KV spans a weight update
  (it kept decoding across it) is never stored, so stale or mixed KV is never served.

Requests that record routed experts (MoE routing replay) skip the lookup: their experts must be
recorded at every position, which a copied prefix would not be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles_engine.radix_tree import RadixNode, RadixTree

if TYPE_CHECKING:
    import torch

    from miles_engine.kv_cache import SlotKVCache
    from miles_engine.sequence import Sequence


@dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0  # admissions that looked for a cached prefix
    hits: int = 0  # ... and found one
    hit_tokens: int = 0  # tokens copied from the pool instead of prefilled
    stored_tokens: int = 0  # tokens copied into the pool
    evicted_tokens: int = 0
    skipped_stale: int = 0  # requests not stored because the weights changed while they ran
    invalidations: int = 0


@dataclass(slots=True)
class _Held:
    node: RadixNode
    epoch: int  # the cache epoch (weight version) the request's KV was computed in


class PrefixCache:
    """Runs on the scheduler thread, between forwards."""

    def __init__(self, slots: SlotKVCache, max_tokens: int) -> None:
        self.slots = slots
        self.max_tokens = max_tokens
        self.tree = RadixTree()
        self.epoch = 0
        self.stats = PrefixCacheStats()
        self.capacity = 0
        self.k: torch.Tensor | None = None  # [layers, kv_heads, capacity, head_dim]
        self.v: torch.Tensor | None = None
        self._free: list[torch.Tensor] = []  # 1-D CPU tensors of free pool rows
        self._held: dict[Sequence, _Held] = {}

    # ------------------------------------------------------------------ requests

    def usable(self, seq: Sequence) -> int:
        """Tokens of ``seq`` (not yet prefilled) that :meth:`restore` would copy from the pool."""
        if seq.return_routed_experts or seq.kv_len:
            return 0
        ids = seq.all_ids
        return self.tree.peek(ids[: len(ids) - 1])

    def restore(self, seq: Sequence, slot: int) -> int:
        """Copy the longest cached prefix of ``seq`` into ``slot`` (reserved by the caller for the
        whole sequence) and hold it; returns its length (``seq.kv_len`` is set to it)."""
        self.stats.lookups += 1
        if seq.return_routed_experts or seq.kv_len:
            return 0
        ids = seq.all_ids
        match = self.tree.match(ids[: len(ids) - 1])
        if not match.length:
            return 0
        import torch

        assert self.k is not None and self.v is not None and self.slots.k is not None and self.slots.v is not None
        rows = torch.cat(match.rows).to(self.k.device)
        self.slots.k[:, slot, :, : match.length].copy_(self.k.index_select(2, rows))
        self.slots.v[:, slot, :, : match.length].copy_(self.v.index_select(2, rows))
        self._hold(seq, match.node)
        seq.kv_len = match.length
        if not seq.output_ids:  # a resumed request reports what its first admission found
            seq.cached_tokens = match.length
        self.stats.hits += 1
        self.stats.hit_tokens += match.length
        return match.length

    def store(self, seq: Sequence, slot: int) -> None:
        """Add the KV of ``seq``'s fed tokens (in ``slot``) to the tree, unless the weights changed
        since it was computed; ``seq`` then holds the stored prefix. A request that holds nothing
        yet is stored right after its prefill (its KV is of the current weights)."""
        held = self._held.get(seq)
        if held is not None and held.epoch != self.epoch:
            self.stats.skipped_stale += 1
            return
        ids = seq.all_ids[: seq.kv_len]
        match = self.tree.match(ids)
        node = match.node
        missing = len(ids) - match.length
        if missing:
            self.tree.hold(node)  # the prefix being extended must survive the eviction below
            rows = self._allocate(missing)
            self.tree.release(node)
            if rows is not None:
                self._copy_in(slot, match.length, rows)
                node = self.tree.extend(node, ids[match.length :], rows)
                self.stats.stored_tokens += missing
        self._hold(seq, node)

    def leave(self, seq: Sequence, slot: int, *, keep: bool) -> None:
        """``seq`` leaves the batch from ``slot``: store its KV first when ``keep``; let go of what it held."""
        if keep and seq in self._held:  # held since its prefill, so its KV's epoch is known
            self.store(seq, slot)
        held = self._held.pop(seq, None)
        if held is not None and held.epoch == self.epoch:
            self.tree.release(held.node)

    # ------------------------------------------------------------------ whole cache

    def invalidate(self) -> None:
        """Drop every entry (the weights changed, or the cache was flushed); the pool's memory stays."""
        self.epoch += 1
        self.stats.invalidations += 1
        self.tree.reset()
        self._free = [self._arange(0, self.capacity)] if self.capacity else []

    def drop_memory(self) -> None:
        """:meth:`invalidate` and give the pool's memory back (``/release_memory_occupation``)."""
        self.invalidate()
        self.k = self.v = None
        self.capacity = 0
        self._free = []

    def info(self) -> dict[str, Any]:
        stats = self.stats
        return {"enabled": True, "max_tokens": self.max_tokens, "capacity_tokens": self.capacity,
                "cached_tokens": self.tree.tokens, "pinned_tokens": self.tree.pinned_tokens,
                "lookups": stats.lookups, "hits": stats.hits, "hit_tokens": stats.hit_tokens,
                "stored_tokens": stats.stored_tokens, "evicted_tokens": stats.evicted_tokens,
                "skipped_stale": stats.skipped_stale, "invalidations": stats.invalidations}

    # ------------------------------------------------------------------ pool

    def _hold(self, seq: Sequence, node: RadixNode) -> None:
        previous = self._held.get(seq)
        self.tree.hold(node)
        if previous is not None and previous.epoch == self.epoch:
            self.tree.release(previous.node)
        self._held[seq] = _Held(node, self.epoch)

    def _free_count(self) -> int:
        return sum(int(chunk.shape[0]) for chunk in self._free)

    def _allocate(self, count: int) -> torch.Tensor | None:
        """``count`` free pool rows (growing the pool, then evicting, as needed); None when they
        cannot be had (the pool is full of prefixes running requests hold, or too small)."""
        import torch

        if count > self.max_tokens:
            return None
        free = self._free_count()
        if free < count and self.capacity < self.max_tokens:
            self._grow(min(self.max_tokens, max(self.capacity * 2, self.capacity + count - free)))
            free = self._free_count()
        if free < count:
            freed = self.tree.evict(count - free)
            self.stats.evicted_tokens += sum(int(rows.shape[0]) for rows in freed)
            self._free.extend(freed)
            free = self._free_count()
        if free < count:
            return None
        pool = torch.cat(self._free) if len(self._free) > 1 else self._free[0]
        self._free = [pool[count:]] if pool.shape[0] > count else []
        return pool[:count].clone()

    def _grow(self, capacity: int) -> None:
        import torch

        cache = self.slots
        shape = (cache.num_layers, cache.num_kv_heads, capacity, cache.head_dim)
        k = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        v = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        if self.k is not None and self.v is not None:
            k[:, :, : self.capacity].copy_(self.k)
            v[:, :, : self.capacity].copy_(self.v)
        self._free.append(self._arange(self.capacity, capacity))
        self.k, self.v, self.capacity = k, v, capacity

    def _copy_in(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Pool ``rows`` <- positions ``start ..`` of ``slot`` (all layers)."""
        assert self.k is not None and self.v is not None and self.slots.k is not None and self.slots.v is not None
        end = start + rows.shape[0]
        index = rows.to(self.k.device)
        self.k.index_copy_(2, index, self.slots.k[:, slot, :, start:end])
        self.v.index_copy_(2, index, self.slots.v[:, slot, :, start:end])

    @staticmethod
    def _arange(start: int, end: int) -> torch.Tensor:
        import torch

        return torch.arange(start, end, dtype=torch.long)
