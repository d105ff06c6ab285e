"""The router's prefix-cache figures as step metrics (``router/*`` in the trackers).

The router already counts them for ``GET /metrics`` (JSON, or Prometheus with ``format=prometheus``):
the ``metrics`` middleware sums the prompt tokens of every ``/generate`` answer and how many of them
the engine's prefix cache served (``meta_info.cached_tokens``); the ``cache_aware`` routing
policy counts the prompt tokens it placed and how many the chosen worker already held. Those
are totals since the router started. At the end of each step the driver reads them (one bounded GET with
the run's token) and logs what the step added:

* ``router/prefix_cache_hit_rate``: cached / prompt tokens of the step's answers (with
  ``router.middlewares`` holding ``metrics``);
* ``router/prefix_routing_hit_rate``: matched / placed prompt tokens (with ``router.policy: cache_aware``);

and the step's token counts beside them. A router restarted by the supervisor starts its totals at 0
again; a step whose totals went down logs nothing for it. A router that does not answer in time
costs the step its figures, never the step.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0

# (snapshot section, its counter of prompt tokens, its counter of hits, the metric's stem)
_COUNTERS = (("metrics", ("total", "tokens", "prompt"), ("total", "tokens", "cached"), "prefix_cache"),
             ("prefix_routing", ("prompt_tokens",), ("matched_tokens",), "prefix_routing"))


def _read(snapshot: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = snapshot
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class RouterCounters:
    """Per-step deltas of the router's cumulative prefix counters (see the module docstring)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def step_metrics(self, snapshot: dict[str, Any]) -> dict[str, float]:
        """The metrics of the step that ends at ``snapshot`` (the router's ``GET /metrics`` JSON)."""
        metrics: dict[str, float] = {}
        for section, prompt_path, hit_path, stem in _COUNTERS:
            part = snapshot.get(section)
            if not isinstance(part, dict):
                continue
            prompt, hits = _read(part, prompt_path), _read(part, hit_path)
            if prompt is None or hits is None:
                continue
            before_prompt, before_hits = self._last.get(stem, (0.0, 0.0))
            self._last[stem] = (prompt, hits)
            step_prompt, step_hits = prompt - before_prompt, hits - before_hits
            if step_prompt < 0 or step_hits < 0:  # the router restarted: its totals began again
                continue
            metrics[f"router/{stem}_prompt_tokens"] = step_prompt
            metrics[f"router/{stem}_hit_tokens"] = step_hits
            if step_prompt > 0:
                metrics[f"router/{stem}_hit_rate"] = step_hits / step_prompt
        return metrics

    async def fetch(self, router_url: str | None) -> dict[str, float]:
        """Read the router's counters (``GET {router_url}/metrics`` with the run's token, at most
        :data:`TIMEOUT_S`) and return the step's metrics; nothing without a router, or when it does
        not answer."""
        if router_url is None:
            return {}
        try:
            snapshot = await asyncio.to_thread(_get_json, f"{router_url.rstrip('/')}/metrics", TIMEOUT_S)
        except Exception as exc:  # a missing figure must never cost the step
            log.debug("router metrics not read: %s", exc)
            return {}
        return self.step_metrics(snapshot) if isinstance(snapshot, dict) else {}


def _get_json(url: str, timeout: float) -> Any:
    """One GET with the run's token (plain ``http.client``: no client object per call)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    from miles_contracts.wire.auth import auth_headers

    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        connection.request("GET", parts.path or "/", headers=auth_headers())
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET {parts.path} answered {response.status}")
        return json.loads(body)
    finally:
        connection.close()
