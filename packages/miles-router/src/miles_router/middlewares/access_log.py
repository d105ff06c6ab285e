"""Middleware ``access_log``: one JSON line per request -- which engines it was tried on, how it
ended, how long it took -- for finding out afterwards why a rollout sample was aborted.

Options: ``path`` (file to append to; default: the ``miles_router.access`` logger at INFO).

A line: ``{"time", "method", "path", "rid", "routing_key", "status", "worker", "attempts",
"tried_workers", "finish_reason", "router_abort", "latency_s", "prompt_tokens",
"completion_tokens"}``; fan-outs have ``"fanout": true`` and ``"failed"`` workers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from miles_contracts import RouterRequest, RouterResponse
from pydantic import BaseModel, ConfigDict

from miles_router.middleware import STATE_ATTEMPTS, STATE_FANOUT, STATE_ROUTER_ABORT, STATE_TRIED

log = logging.getLogger("miles_router.access")


class AccessLogOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: Path | None = None


class AccessLogMiddleware:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    async def __call__(self, request: RouterRequest,
                       call_next: Callable[[RouterRequest], Awaitable[RouterResponse]]) -> RouterResponse:
        start = time.perf_counter()
        response: RouterResponse | None = None
        try:
            response = await call_next(request)
            return response
        finally:
            self._write(self._entry(request, response, time.perf_counter() - start))

    def _entry(self, request: RouterRequest, response: RouterResponse | None, latency: float) -> dict[str, Any]:
        body = request.body or {}
        entry: dict[str, Any] = {
            "time": time.time(), "method": request.method, "path": request.path,
            "rid": body.get("rid"), "routing_key": request.routing_key,
            "status": response.status_code if response is not None else None,
            "worker": response.worker_url if response is not None else None,
            "attempts": request.state.get(STATE_ATTEMPTS), "tried_workers": request.state.get(STATE_TRIED),
            "router_abort": request.state.get(STATE_ROUTER_ABORT), "latency_s": round(latency, 6),
        }
        answer = response.body if response is not None else None
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if isinstance(meta, dict):
            entry["finish_reason"] = meta.get("finish_reason")
            entry["prompt_tokens"] = meta.get("prompt_tokens")
            entry["completion_tokens"] = meta.get("completion_tokens")
        if request.state.get(STATE_FANOUT):
            entry["fanout"] = True
            entry["failed"] = answer.get("failed") if isinstance(answer, dict) else None
        return entry

    def _write(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, default=str)
        if self.path is None:
            log.info("%s", line)
            return
        with self._lock, self.path.open("a") as handle:
            handle.write(line + "\n")


def access_log(options: dict[str, Any]) -> AccessLogMiddleware:
    """Factory registered as ``access_log``."""
    return AccessLogMiddleware(**AccessLogOptions.model_validate(options).model_dump())
