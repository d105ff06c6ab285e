"""Requests that go to every worker: abort, pause/continue, cache flush and weight updates.

Targets are the workers that answer (serving, and those held back for stale weights -- a weight
update is how they catch up); quarantined and pending ones are skipped and listed as such. The
answer aggregates every worker's result::

    {"success": bool, "message": str,
     "workers": [{"url", "success", "status_code", "response", "error"}, ...],
     "failed": [url, ...], "skipped": {url: reason}}

with HTTP 200 when every target succeeded, 502 when some failed (``failed`` names them), the
workers' 4xx when every one refused the request as a client error, 503 when there was no worker
to send it to. A worker succeeded when it answered 2xx and did not say
``"success": false``.

After a weight update the router reads each updated worker's ``weight_version`` and makes it the
fleet's; workers whose update failed are then behind and stop serving (see :mod:`miles_router.fleet`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from miles_contracts import RouterRequest, RouterResponse

from miles_router.fleet import Fleet
from miles_router.health import describe_error
from miles_router.middleware import STATE_FANOUT, STATE_QUERY
from miles_router.versions import as_version, consensus
from miles_router.workers import Worker

WEIGHT_UPDATE_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weight_version",
})
FANOUT_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", *WEIGHT_UPDATE_PATHS,
})
_SLOW_ANSWER = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


@dataclass(slots=True)
class WorkerResult:
    url: str
    success: bool
    status_code: int | None = None
    response: Any = None
    error: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "success": self.success, "status_code": self.status_code,
                "response": self.response, "error": self.error}


Effect = Callable[["Broadcaster", RouterRequest, list[tuple[Worker, WorkerResult]]], Awaitable[None]]


class Broadcaster:
    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, *, request_timeout: float,
                 connect_timeout: float, probe_timeout: float) -> None:
        self.fleet = fleet
        self.client = client
        self.timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
        self.probe_timeout = probe_timeout

    async def broadcast(self, request: RouterRequest) -> RouterResponse:
        request.state[STATE_FANOUT] = True
        targets = self.fleet.reachable()
        skipped = {w.url: f"{w.state.value}: {w.reason}" for w in self.fleet if w not in targets}
        if not targets:
            hint = f" (skipped: {skipped})" if skipped else "; add one with POST /add_worker?url=..."
            message = f"no reachable worker to send {request.path} to{hint}"
            return RouterResponse(503, {"success": False, "message": message, "workers": [], "failed": [],
                                        "skipped": skipped})
        results = await asyncio.gather(*(self._send(worker, request) for worker in targets))
        effect = _EFFECTS.get(request.path)
        if effect is not None:
            await effect(self, request, list(zip(targets, results, strict=True)))
        failed = [r for r in results if not r.success]
        if failed:
            message = f"{len(failed)} of {len(results)} workers failed {request.path}: " + "; ".join(
                f"{r.url}: {r.error}" for r in failed)
        else:
            message = f"{request.path} succeeded on all {len(results)} workers"
        body = {"success": not failed, "message": message, "workers": [r.describe() for r in results],
                "failed": [r.url for r in failed], "skipped": skipped}
        return RouterResponse(200 if not failed else _refused_by_all(results) or 502, body)

    async def _send(self, worker: Worker, request: RouterRequest) -> WorkerResult:
        try:
            response = await self.client.request(
                request.method, worker.url + request.path, params=request.state.get(STATE_QUERY) or None,
                content=None if request.body is None else json.dumps(request.body).encode(),
                headers={"content-type": "application/json"}, timeout=self.timeout,  # + the client's token
            )
        except _SLOW_ANSWER as exc:  # the engine is there, only slow: not a health failure
            return WorkerResult(worker.url, False, error=f"no answer within the timeout ({describe_error(exc)})")
        except httpx.HTTPError as exc:
            if worker in self.fleet:
                self.fleet.record_failure(worker, describe_error(exc))
            return WorkerResult(worker.url, False, error=describe_error(exc))
        body = _decode(response)
        said_failure = isinstance(body, dict) and body.get("success") is False
        ok = response.is_success and not said_failure
        error = None
        if not ok:
            detail = body.get("message") or body.get("detail") if isinstance(body, dict) else body
            error = f"HTTP {response.status_code}: {str(detail)[:300]}"
        return WorkerResult(worker.url, ok, response.status_code, body, error)

    async def read_version(self, worker: Worker) -> str | None:
        try:
            response = await self.client.get(worker.url + "/model_info", timeout=self.probe_timeout)
            return as_version(response.json().get("weight_version")) if response.is_success else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None


def _refused_by_all(results: list[WorkerResult]) -> int | None:
    """The 4xx to answer when every worker refused the request as a client error (an empty weight
    version, say): the request was bad, not the fleet, and a 502 would blame the engines. Their
    common status, or 400 when they differ; None when any worker did otherwise."""
    codes = {r.status_code for r in results if r.status_code is not None and 400 <= r.status_code < 500}
    if not codes or any(r.status_code not in codes for r in results):
        return None
    return codes.pop() if len(codes) == 1 else 400


def _decode(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


Outcome = list[tuple[Worker, WorkerResult]]


async def _paused(broadcaster: Broadcaster, request: RouterRequest, outcome: Outcome) -> None:
    reached = [worker for worker, result in outcome if result.success]
    if reached:
        broadcaster.fleet.record_pause(dict(request.body or {}), reached)


async def _continued(broadcaster: Broadcaster, request: RouterRequest, outcome: Outcome) -> None:
    reached = [worker for worker, result in outcome if result.success]
    if reached:
        broadcaster.fleet.record_pause(None, reached)


async def _weights_updated(broadcaster: Broadcaster, request: RouterRequest, outcome: Outcome) -> None:
    updated = [worker for worker, result in outcome if result.success]
    versions = await asyncio.gather(*(broadcaster.read_version(worker) for worker in updated))
    known = []
    for worker, version in zip(updated, versions, strict=True):
        if version is not None:
            worker.weight_version = version
            known.append(version)
    if known:
        broadcaster.fleet.adopt_version(consensus(known))


_EFFECTS: dict[str, Effect] = {
    "/pause_generation": _paused,
    "/continue_generation": _continued,
    **{path: _weights_updated for path in WEIGHT_UPDATE_PATHS},
}
