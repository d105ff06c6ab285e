"""Cache-aware placement (``router.policy: cache_aware``): a request without a routing key goes to
the worker that most likely holds the longest prefix of it in its radix cache, unless that worker
is busier than the least busy one by more than ``router.prefix_max_imbalance`` requests.

The router cannot see the engines' caches, so it remembers what it sent where: per worker, the
chained hashes of the leading 16-token blocks of every prompt (``input_ids``; for ``text``
prompts, 64-character blocks) it placed there, least recently used forgotten beyond
:data:`INDEX_BLOCKS` blocks. Block ``i``'s hash covers blocks ``0 .. i``, so "the first ``n``
hashes are known on worker ``w``" means ``w`` was sent a prompt starting with those ``n x 16``
tokens. A lookup is one dictionary probe per block per worker, where a per-worker radix tree of
tokens (SGLang's router keeps one of characters) costs a walk per character; the price is
granularity: a shared prefix counts in whole blocks.

The choice, among workers that can take the request:

1. keep those within ``prefix_max_imbalance`` requests in flight of the least busy (a hot prefix
   must not pile every request onto one worker while others idle);
2. among them, the longest known prefix wins (ties: fewer in flight, then dispatched less often);
3. no worker knows any block of it: least in flight, as without this policy.

Keyed requests (``X-SMG-Routing-Key``) keep their session affinity (:mod:`miles_router.selection`).
What the index believes can be stale (an engine evicted the prefix, or dropped its whole cache at a
weight update): the request is still placed on a worker whose cache *will* hold that prefix after
this request, so the next one sharing it hits. Counters (``snapshot`` / ``prometheus``) say how
often placement found a prefix and how many prompt tokens it covered; the engines' own
``cached_tokens`` (what was really reused) are counted by the ``metrics`` middleware.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from miles_router.selection import AffinityTable, LeastInFlight
from miles_router.workers import Worker

TOKEN_BLOCK = 16
TEXT_BLOCK = 64
INDEX_BLOCKS = 1 << 16  # per worker: 1M tokens of prefixes at 16 tokens a block


def prefix_blocks(body: Any) -> tuple[list[int], int]:
    """Chained hashes of the full leading blocks of a ``/generate`` body's prompt, and the prompt's
    length in tokens (or characters); ``([], 0)`` when the body has no single prompt."""
    if not isinstance(body, dict):
        return [], 0
    ids, text = body.get("input_ids"), body.get("text")
    blocks: list[Any]
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        length = len(ids)
        blocks = [tuple(ids[s : s + TOKEN_BLOCK]) for s in range(0, length - TOKEN_BLOCK + 1, TOKEN_BLOCK)]
    elif isinstance(text, str) and text:
        length = len(text)
        blocks = [text[s : s + TEXT_BLOCK] for s in range(0, length - TEXT_BLOCK + 1, TEXT_BLOCK)]
    else:  # batched prompts, or none: no single prefix to place by
        return [], 0
    hashes, chained = [], 0
    for block in blocks:
        chained = hash((chained, block))
        hashes.append(chained)
    return hashes, length


@dataclass(slots=True)
class PlacementStats:
    requests: int = 0  # unkeyed requests with a prompt placed by this policy
    placed_on_prefix: int = 0  # ... sent to a worker that knew a prefix of them
    prompt_units: int = 0  # their prompt tokens (characters for text prompts)
    matched_units: int = 0  # ... covered by the known prefix of the worker chosen
    held_back: int = 0  # times a worker with a longer prefix was passed over as too busy

    def snapshot(self) -> dict[str, Any]:
        rate = self.matched_units / self.prompt_units if self.prompt_units else 0.0
        return {"requests": self.requests, "placed_on_prefix": self.placed_on_prefix,
                "prompt_tokens": self.prompt_units, "matched_tokens": self.matched_units,
                "hit_rate": round(rate, 4), "held_back_for_load": self.held_back}


class PrefixIndex:
    """Per worker URL: the prefix-block hashes sent to it, least recently used forgotten first."""

    def __init__(self, capacity: int = INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._blocks: dict[str, collections.OrderedDict[int, None]] = {}

    def matched(self, url: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` ``url`` was sent."""
        known = self._blocks.get(url)
        if not known:
            return 0
        count = 0
        for value in hashes:
            if value not in known:
                break
            count += 1
        return count

    def record(self, url: str, hashes: Sequence[int]) -> None:
        known = self._blocks.setdefault(url, collections.OrderedDict())
        for value in hashes:
            known[value] = None
            known.move_to_end(value)
        while len(known) > self.capacity:
            known.popitem(last=False)

    def forget(self, url: str) -> None:
        self._blocks.pop(url, None)


class CacheAware(LeastInFlight):
    """:class:`LeastInFlight` with prefix-aware placement of unkeyed requests (see the module)."""

    def __init__(self, affinity: AffinityTable, max_imbalance: int, index: PrefixIndex | None = None) -> None:
        super().__init__(affinity)
        self.max_imbalance = max_imbalance
        self.index = index or PrefixIndex()
        self.stats = PlacementStats()

    def choose(self, candidates: Sequence[Worker], routing_key: str | None, exclude: Collection[str] = (),
               body: Any = None) -> Worker | None:
        hashes, length = prefix_blocks(body) if not routing_key else ([], 0)
        if not length:
            return super().choose(candidates, routing_key, exclude)
        usable = [w for w in candidates if w.url not in exclude]
        if not usable:
            return None
        least = min(w.in_flight for w in usable)
        near = [w for w in usable if w.in_flight <= least + self.max_imbalance]
        known = {w.url: self.index.matched(w.url, hashes) for w in usable}
        chosen = max(near, key=lambda w: (known[w.url], -w.in_flight, -w.dispatched))
        if not known[chosen.url]:
            chosen = min(usable, key=lambda w: (w.in_flight, w.dispatched))
        self.stats.held_back += int(max(known.values()) > known[chosen.url])
        self.stats.requests += 1
        self.stats.prompt_units += length
        block = TOKEN_BLOCK if isinstance(body.get("input_ids"), list) else TEXT_BLOCK
        self.stats.matched_units += known[chosen.url] * block
        self.stats.placed_on_prefix += int(known[chosen.url] > 0)
        self.index.record(chosen.url, hashes)
        return chosen

    def snapshot(self) -> dict[str, Any]:
        return {"policy": "cache_aware", "max_imbalance": self.max_imbalance, **self.stats.snapshot()}

    def prometheus(self) -> str:
        stats = self.stats
        return "\n".join([
            "# TYPE miles_router_prefix_requests_total counter",
            f"miles_router_prefix_requests_total {stats.requests}",
            "# TYPE miles_router_prefix_placed_total counter",
            f"miles_router_prefix_placed_total {stats.placed_on_prefix}",
            "# TYPE miles_router_prefix_tokens_total counter",
            f'miles_router_prefix_tokens_total{{kind="prompt"}} {stats.prompt_units}',
            f'miles_router_prefix_tokens_total{{kind="matched"}} {stats.matched_units}',
            "# TYPE miles_router_prefix_held_back_total counter",
            f"miles_router_prefix_held_back_total {stats.held_back}",
        ]) + "\n"
