"""Which worker gets a request: session affinity first, then the least requests in flight.

Affinity is a sticky table, not a hash ring: a routing key seen for the first time goes to the
least-loaded worker and stays there while that worker serves (its prefix cache holds the session).
When the worker leaves (quarantined, held back, removed) or a request on it fails, the key moves to
the least-loaded worker and stays there in turn; it does not move back when the first one returns,
since the new worker now holds the cache. The table forgets the least recently used keys beyond
``capacity``.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from typing import Any

from miles_router.workers import Worker


class AffinityTable:
    """Routing key -> worker URL, least recently used keys forgotten first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"affinity capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._urls: collections.OrderedDict[str, str] = collections.OrderedDict()

    def get(self, key: str) -> str | None:
        url = self._urls.get(key)
        if url is not None:
            self._urls.move_to_end(key)
        return url

    def set(self, key: str, url: str) -> None:
        self._urls[key] = url
        self._urls.move_to_end(key)
        while len(self._urls) > self.capacity:
            self._urls.popitem(last=False)

    def __len__(self) -> int:
        return len(self._urls)


class LeastInFlight:
    """Picks among serving workers: the affinity key's worker if it can take the request, else
    the one with the fewest requests in flight (ties: the one dispatched to least often)."""

    def __init__(self, affinity: AffinityTable) -> None:
        self.affinity = affinity

    def choose(self, candidates: Sequence[Worker], routing_key: str | None,
               exclude: Collection[str] = (), body: Any = None) -> Worker | None:
        """``body``: the request's JSON body, for policies that place by its content (this one does not)."""
        usable = [w for w in candidates if w.url not in exclude]
        if not usable:
            return None
        if routing_key:
            sticky = self.affinity.get(routing_key)
            for worker in usable:
                if worker.url == sticky:
                    return worker
        chosen = min(usable, key=lambda w: (w.in_flight, w.dispatched))
        if routing_key:
            self.affinity.set(routing_key, chosen.url)
        return chosen
