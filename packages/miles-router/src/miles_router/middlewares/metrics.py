"""Middleware ``metrics``: request counts, errors, aborts, failovers, latency percentiles and
tokens -- in total, per worker and per path -- shown at ``GET /metrics``.

Options: ``window`` (latencies kept per series for the percentiles, default 2048).

An *error* is an answer with HTTP status >= 400 or an abort the router made itself; an *abort* is
any answer whose ``finish_reason`` is ``abort`` (the engine's or the router's); a *failover* is a
request that needed more than one engine. Latency is from entering this middleware to the
response (to its first byte for streams). Tokens are ``meta_info.prompt_tokens``,
``completion_tokens`` and ``cached_tokens`` (prompt tokens the engine's prefix cache served; their
share of the prompt tokens is ``prefix_cache_hit_rate``) of ``/generate`` answers from engines.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from miles_contracts import RouterRequest, RouterResponse
from pydantic import BaseModel, ConfigDict, Field

from miles_router.middleware import STATE_ATTEMPTS, STATE_ROUTER_ABORT

_QUANTILES = (0.5, 0.9, 0.99)


class MetricsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window: int = Field(default=2048, ge=1, description="latencies kept per series for percentiles")


class _Series:
    """Counters and a latency window for one slice (all requests, one worker, one path)."""

    def __init__(self, window: int) -> None:
        self.requests = 0
        self.errors = 0
        self.aborts = 0
        self.failovers = 0
        self.status = collections.Counter[str]()
        self.finish_reasons = collections.Counter[str]()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache served (meta_info.cached_tokens)
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)

    def record(self, status: int, latency: float, outcome: _Outcome) -> None:
        self.requests += 1
        self.status[str(status)] += 1
        self.errors += int(status >= 400 or outcome.router_abort)
        self.aborts += int("abort" in outcome.finish_reasons)
        self.failovers += int(outcome.attempts > 1)
        self.finish_reasons.update(outcome.finish_reasons)
        self.prompt_tokens += outcome.prompt_tokens
        self.completion_tokens += outcome.completion_tokens
        self.cached_tokens += outcome.cached_tokens
        self.latencies.append(latency)

    def snapshot(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        latency: dict[str, float | int | None] = {"count": len(ordered),
                                                  "mean": sum(ordered) / len(ordered) if ordered else None}
        for q in _QUANTILES:
            latency[f"p{round(q * 100)}"] = _quantile(ordered, q)
        return {"requests": self.requests, "errors": self.errors, "aborts": self.aborts,
                "failovers": self.failovers,
                "status": dict(self.status), "finish_reasons": dict(self.finish_reasons),
                "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens,
                           "cached": self.cached_tokens},
                "prefix_cache_hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
                "latency_s": latency}


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    rank = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))  # nearest rank
    return ordered[rank]


class _Outcome:
    __slots__ = ("attempts", "cached_tokens", "completion_tokens", "finish_reasons", "prompt_tokens", "router_abort")

    def __init__(self, request: RouterRequest, response: RouterResponse | None) -> None:
        self.attempts = int(request.state.get(STATE_ATTEMPTS, 1) or 1)
        self.router_abort = STATE_ROUTER_ABORT in request.state
        self.finish_reasons: list[str] = []
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        body = response.body if response is not None else None
        for item in body if isinstance(body, list) else [body]:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                continue
            reason = meta.get("finish_reason")
            if isinstance(reason, dict) and isinstance(reason.get("type"), str):
                self.finish_reasons.append(reason["type"])
            if not self.router_abort:  # no engine saw those tokens
                self.prompt_tokens += _count(meta.get("prompt_tokens"))
                self.completion_tokens += _count(meta.get("completion_tokens"))
                self.cached_tokens += _count(meta.get("cached_tokens"))


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class MetricsMiddleware:
    def __init__(self, window: int = 2048) -> None:
        self.window = window
        self.total = _Series(window)
        self.by_worker: dict[str, _Series] = {}
        self.by_path: dict[str, _Series] = {}
        self.started = time.time()

    async def __call__(self, request: RouterRequest,
                       call_next: Callable[[RouterRequest], Awaitable[RouterResponse]]) -> RouterResponse:
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except BaseException:
            self._record(request, None, 500, time.perf_counter() - start)
            raise
        self._record(request, response, response.status_code, time.perf_counter() - start)
        return response

    def _record(self, request: RouterRequest, response: RouterResponse | None, status: int,
                latency: float) -> None:
        outcome = _Outcome(request, response)
        slices = [self.total, self._series(self.by_path, request.path)]
        worker = response.worker_url if response is not None else None
        if worker is not None:  # fan-outs and the router's own aborts have no single worker
            slices.append(self._series(self.by_worker, worker))
        for series in slices:
            series.record(status, latency, outcome)

    def _series(self, table: dict[str, _Series], key: str) -> _Series:
        series = table.get(key)
        if series is None:
            series = table[key] = _Series(self.window)
        return series

    def snapshot(self) -> dict[str, Any]:
        return {"since": self.started, "total": self.total.snapshot(),
                "by_worker": {url: s.snapshot() for url, s in self.by_worker.items()},
                "by_path": {path: s.snapshot() for path, s in self.by_path.items()}}

    def prometheus(self) -> str:
        lines: list[str] = []
        counters = {"requests": "requests_total", "errors": "errors_total", "aborts": "aborts_total",
                    "failovers": "failovers_total"}
        for attribute, metric in counters.items():
            lines.append(f"# TYPE miles_router_{metric} counter")
            lines += [f'miles_router_{metric}{{worker="{url}"}} {getattr(s, attribute)}'
                      for url, s in self.by_worker.items()]
        lines.append("# TYPE miles_router_tokens_total counter")
        for url, s in self.by_worker.items():
            lines.append(f'miles_router_tokens_total{{worker="{url}",kind="prompt"}} {s.prompt_tokens}')
            lines.append(f'miles_router_tokens_total{{worker="{url}",kind="completion"}} {s.completion_tokens}')
            lines.append(f'miles_router_tokens_total{{worker="{url}",kind="cached"}} {s.cached_tokens}')
        lines.append("# TYPE miles_router_latency_seconds summary")
        for url, s in self.by_worker.items():
            ordered = sorted(s.latencies)
            for q in _QUANTILES:
                value = _quantile(ordered, q)
                if value is not None:
                    lines.append(f'miles_router_latency_seconds{{worker="{url}",quantile="{q}"}} {value:.6f}')
        return "\n".join(lines) + "\n"


def metrics(options: dict[str, Any]) -> MetricsMiddleware:
    """Factory registered as ``metrics``."""
    return MetricsMiddleware(**MetricsOptions.model_validate(options).model_dump())
