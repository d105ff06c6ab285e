"""Periodic health probes: ``GET /health``, then the weight version from ``GET /model_info``.

What a probe means is decided by :class:`~miles_router.fleet.Fleet`; this module only talks HTTP.
A worker that comes back (or answers for the first time) is first brought to the fleet's pause
state -- it may have missed a ``/pause_generation`` or ``/continue_generation`` while it was away --
and then admitted, or held back if its weights are stale.

An engine that answers ``/health`` with 503 ``{"status": "paused"}`` is alive and holding
generation on purpose (a weight sync pauses every engine for a moment): that is not a failure and
never leads to quarantine; the worker is marked paused, and new requests prefer workers that are not.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from miles_router.fleet import Fleet
from miles_router.versions import as_version
from miles_router.workers import Worker

log = logging.getLogger(__name__)


class ProbeFailed(Exception):
    """A probe got no usable answer; the message says what happened."""


class Probe:
    """A worker that answered: its weight version (None: not reported) and whether it is paused."""

    __slots__ = ("paused", "version")

    def __init__(self, version: str | None, paused: bool = False) -> None:
        self.version, self.paused = version, paused


def describe_error(exc: BaseException) -> str:
    """``ConnectError: [Errno 111] Connection refused`` -- short and specific, for people."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class HealthMonitor:
    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, *, interval: float, timeout: float) -> None:
        self.fleet = fleet
        self.client = client
        self.interval = interval
        self.timeout = timeout

    async def run(self) -> None:
        """Probe every worker each ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")

    async def check_all(self) -> None:
        workers = list(self.fleet)
        probes = await asyncio.gather(*(self._probe_or_failure(worker) for worker in workers))
        self.fleet.seed_version([p.version for p in probes if isinstance(p, Probe) and p.version is not None])
        await asyncio.gather(*(self._apply(w, p) for w, p in zip(workers, probes, strict=True)))

    async def check(self, worker: Worker) -> None:
        await self._apply(worker, await self._probe_or_failure(worker))

    async def _probe_or_failure(self, worker: Worker) -> Probe | ProbeFailed:
        """What the worker answered, or why the probe failed."""
        try:
            return await self._probe(worker)
        except ProbeFailed as exc:
            return exc

    async def _apply(self, worker: Worker, probe: Probe | ProbeFailed) -> None:
        if isinstance(probe, ProbeFailed):
            if worker in self.fleet:
                self.fleet.record_failure(worker, str(probe))
            return
        worker.paused = probe.paused
        version = probe.version
        if probe.paused and version is None:  # a paused answer without a version: keep the last one known
            version = worker.weight_version
        if worker not in self.fleet.reachable() and self.fleet.pause_known:
            # Back from quarantine (or new): it missed the fan-outs meanwhile. Held back or not,
            # from now on it gets every fan-out, so this is the one catch-up it needs.
            try:
                await self._sync_pause(worker)
            except ProbeFailed as exc:
                self.fleet.record_failure(worker, f"could not bring it to the fleet's pause state: {exc}")
                return
        if self.fleet.record_alive(worker, version):
            self.fleet.admit(worker)
        log.info("worker %s admitted (weight_version %s)", worker.url, worker.weight_version)

    async def _probe(self, worker: Worker) -> Probe:
        health = await self._call("GET", worker, "/health")
        if health.status_code == 503 and _says_paused(health):
            return Probe(as_version(health.json().get("weight_version")), paused=True)
        if health.status_code != 200:
            raise ProbeFailed(f"GET /health answered HTTP {health.status_code}")
        info = await self._call("GET", worker, "/model_info")
        if info.status_code == 404:  # an engine without the endpoint: versions are not checked
            return Probe(None)
        if info.status_code != 200:
            raise ProbeFailed(f"GET /model_info answered HTTP {info.status_code}"
                              + (" (the router's token is not the engine's)" if info.status_code == 401 else ""))
        try:
            return Probe(as_version(info.json().get("weight_version")))
        except (ValueError, AttributeError):
            raise ProbeFailed("GET /model_info did not answer a JSON object") from None

    async def _sync_pause(self, worker: Worker) -> None:
        request = self.fleet.pause_request
        if request is None:
            response = await self._call("POST", worker, "/continue_generation", {})
        else:
            response = await self._call("POST", worker, "/pause_generation", request)
        if response.status_code >= 400:
            raise ProbeFailed(f"answered HTTP {response.status_code}: {response.text[:200]}")

    async def _call(self, method: str, worker: Worker, path: str, body: dict | None = None) -> httpx.Response:
        # the client carries the router's token (Router.start)
        try:
            return await self.client.request(method, worker.url + path, json=body, timeout=self.timeout)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # InvalidURL is no HTTPError, and would end the round
            raise ProbeFailed(f"{method} {path}: {describe_error(exc)}") from None


def _says_paused(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "paused"
