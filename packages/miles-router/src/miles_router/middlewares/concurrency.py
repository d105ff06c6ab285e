"""Middleware ``concurrency_limit``: at most ``max_in_flight`` requests reach the engines at once;
the rest wait at the router, in arrival order.

Why: an engine that accepts everything queues it internally, committed to that engine; waiting at
the router instead means each request is placed when a slot frees, on whichever engine is least
loaded *then* (and on the survivors if one dies meanwhile), and engine memory stays bounded.
Fan-outs (abort, pause, weight updates) are never held back: they must reach the engines now.

Options: ``max_in_flight`` (required, >= 1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from miles_contracts import RouterRequest, RouterResponse
from pydantic import BaseModel, ConfigDict, Field

from miles_router.fanout import FANOUT_PATHS


class ConcurrencyLimitOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_in_flight: int = Field(ge=1)


class ConcurrencyLimitMiddleware:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self.waiting = 0
        self.running = 0

    async def __call__(self, request: RouterRequest,
                       call_next: Callable[[RouterRequest], Awaitable[RouterResponse]]) -> RouterResponse:
        if request.path in FANOUT_PATHS:
            return await call_next(request)
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await call_next(request)
        finally:
            self.running -= 1
            self._slots.release()

    def snapshot(self) -> dict[str, Any]:
        return {"max_in_flight": self.max_in_flight, "running": self.running, "waiting": self.waiting}

    def prometheus(self) -> str:
        return (f"# TYPE miles_router_concurrency_running gauge\nmiles_router_concurrency_running {self.running}\n"
                f"# TYPE miles_router_concurrency_waiting gauge\nmiles_router_concurrency_waiting {self.waiting}\n")


def concurrency_limit(options: dict[str, Any]) -> ConcurrencyLimitMiddleware:
    """Factory registered as ``concurrency_limit``."""
    return ConcurrencyLimitMiddleware(**ConcurrencyLimitOptions.model_validate(options).model_dump())
