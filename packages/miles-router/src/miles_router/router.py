"""`Router`: the fleet, health checks, forwarding, fan-out and the middleware chain, without HTTP
serving (``miles_router.app`` puts FastAPI in front of it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import httpx
from miles_contracts import RouterRequest, RouterResponse
from miles_contracts.wire.auth import auth_headers

from miles_router.adapters import AdapterPerVersion
from miles_router.config import RouterSection
from miles_router.fanout import FANOUT_PATHS, Broadcaster
from miles_router.fleet import Fleet
from miles_router.health import HealthMonitor
from miles_router.middleware import NamedMiddleware, compose
from miles_router.prefix_routing import CacheAware
from miles_router.proxy import Forwarder
from miles_router.selection import AffinityTable, LeastInFlight
from miles_router.workers import Worker, normalize_worker_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0  # a dead host must fail over quickly, whatever the request timeout


class Router:
    """Routes engine-protocol requests over a fleet of workers.

    ``await router.start()`` probes the initial workers once (so it routes from the first request)
    and starts the health loop; ``await router.close()`` stops it.
    """

    def __init__(self, section: RouterSection, workers: Sequence[str] = (),
                 middlewares: Sequence[NamedMiddleware] = (), *, auth_token: str | None = None,
                 adapters: AdapterPerVersion | None = None) -> None:
        self.section = section
        self.auth_token = auth_token  # sent to the engines (None: the run's, MILES_AUTH_TOKEN)
        self.fleet = Fleet(failure_threshold=section.failure_threshold,
                           check_weight_version=section.check_weight_version)
        for url in workers:
            self.fleet.add(url)
        affinity = AffinityTable(section.affinity_capacity)
        self.policy = (CacheAware(affinity, section.prefix_max_imbalance) if section.policy == "cache_aware"
                       else LeastInFlight(affinity))
        self.middlewares = list(middlewares)
        self.adapters = adapters  # LoRA on SGLang (miles_router.adapters), handed to the forwarder
        self._chain = compose(self.middlewares, self._dispatch)
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # Keep-alive shorter than uvicorn's 5 s so an engine never closes a connection we reuse.
        # trust_env=False: the run's engines are never reached through HTTP_PROXY (a proxy would see
        # the run's token, and one for the outside world cannot reach loopback at all).
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024,
                                                             keepalive_expiry=2.0),
                                         headers=auth_headers(self.auth_token), trust_env=False)
        timeouts = {"connect_timeout": min(CONNECT_TIMEOUT, self.section.request_timeout)}
        self.monitor = HealthMonitor(self.fleet, self._client, interval=self.section.health_interval,
                                     timeout=self.section.health_timeout)
        self.forwarder = Forwarder(self.fleet, self.policy, self._client, max_attempts=self.section.max_attempts,
                                   request_timeout=self.section.request_timeout,
                                   lean=self.section.forward_client == "lean", auth_token=self.auth_token,
                                   adapters=self.adapters, **timeouts)
        self.broadcaster = Broadcaster(self.fleet, self._client, request_timeout=self.section.request_timeout,
                                       probe_timeout=self.section.health_timeout, **timeouts)
        await self.monitor.check_all()
        self._health_task = asyncio.create_task(self.monitor.run(), name="miles-router-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._client is not None:
            await self.forwarder.aclose()
            await self._client.aclose()

    # ------------------------------------------------------------------ requests

    async def handle(self, request: RouterRequest) -> RouterResponse:
        """Run ``request`` through the middleware chain to an engine (or to every engine)."""
        return await self._chain(request)

    async def _dispatch(self, request: RouterRequest) -> RouterResponse:
        if request.path in FANOUT_PATHS:
            return await self.broadcaster.broadcast(request)
        return await self.forwarder.forward(request)

    # ------------------------------------------------------------------ workers

    async def add_worker(self, url: str) -> tuple[Worker, bool]:
        """Register ``url`` and probe it at once; returns the worker and whether it is new.

        An engine that does not answer yet stays ``pending`` and joins when it does.
        """
        worker, added = self.fleet.add(url)
        if added:
            log.info("worker %s added", worker.url)
            await self.monitor.check(worker)
        return worker, added

    def remove_worker(self, url: str) -> Worker:
        worker = self.fleet.remove(normalize_worker_url(url))
        log.info("worker %s removed (%d requests still in flight finish there)", worker.url, worker.in_flight)
        return worker

    def list_workers(self) -> dict[str, Any]:
        workers = [w.describe() for w in self.fleet]
        return {"workers": workers, "urls": [w["url"] for w in workers], **self.fleet.describe()}

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(serves now, body)``. ``status`` is ``ok`` while a serving worker is not paused,
        ``paused`` while every serving worker is (a weight sync pauses them all; a request sent now
        waits on one until the sync continues it), ``unavailable`` when none serves. Only ``ok``
        serves now; ``paused`` is the engines' own word for alive but held (see
        :meth:`miles_router.fleet.Fleet.routable`), so whoever treats a paused engine as up treats
        this router the same way."""
        serving = self.fleet.serving()
        unpaused = [w for w in serving if not w.paused]
        status = "ok" if unpaused else "paused" if serving else "unavailable"
        body: dict[str, Any] = {"status": status, "healthy_workers": len(serving),
                                "paused_workers": len(serving) - len(unpaused), "workers": len(self.fleet),
                                **self.fleet.describe()}
        if status == "paused":
            body["message"] = (f"every serving worker ({len(serving)}) is paused; requests wait until "
                               "POST /continue_generation resumes them (a weight sync does)")
        elif status == "unavailable":
            body["message"] = (f"no healthy worker among {len(self.fleet)}: {self.fleet.counts()}" if len(self.fleet)
                               else "no worker is registered; add one with POST /add_worker?url=...")
        return bool(unpaused), body

    def metrics(self) -> dict[str, Any]:
        gauges = {"in_flight": sum(w.in_flight for w in self.fleet), "affinity_keys": len(self.policy.affinity),
                  **self.fleet.describe(),
                  "workers": {w.url: {"state": w.state.value, "in_flight": w.in_flight, "dispatched": w.dispatched,
                                      "failed_requests": w.failed_requests, "weight_version": w.weight_version}
                              for w in self.fleet}}
        snapshot: dict[str, Any] = {"router": gauges}
        if isinstance(self.policy, CacheAware):
            snapshot["prefix_routing"] = self.policy.snapshot()
        for link in self.middlewares:
            if link.report is not None:
                snapshot[link.name] = link.report.snapshot()
        return snapshot

    def prometheus(self) -> str:
        lines = ["# TYPE miles_router_worker_in_flight gauge"]
        lines += [f'miles_router_worker_in_flight{{worker="{w.url}"}} {w.in_flight}' for w in self.fleet]
        lines.append("# TYPE miles_router_worker_healthy gauge")
        lines += [f'miles_router_worker_healthy{{worker="{w.url}"}} {int(w.serving)}' for w in self.fleet]
        if isinstance(self.policy, CacheAware):
            lines.append(self.policy.prometheus().rstrip("\n"))
        for link in self.middlewares:
            text = link.report.prometheus().rstrip("\n") if link.report is not None else ""
            if text:
                lines.append(text)
        return "\n".join(lines) + "\n"
