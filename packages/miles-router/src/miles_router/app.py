"""The router's HTTP face (FastAPI).

Own endpoints: ``POST /add_worker`` and ``POST /remove_worker`` (``?url=`` or ``{"url": ...}``),
``GET /list_workers``, ``GET /health`` (200 when a worker serves; else 503, with ``"status": "paused"``
while every serving worker is paused, as a paused engine answers; to anyone, so it says no more
than that: the fleet's state is in ``/list_workers``), ``GET /metrics``
(``?format=prometheus`` for the text format). Fan-out paths go to every worker
(:mod:`miles_router.fanout`); every other path -- ``/generate``, ``/model_info``,
``/health_generate``, ``/v1/...`` -- goes to one worker with failover (:mod:`miles_router.proxy`).
Errors are ``{"detail": <what was wrong and how to fix it>}`` with a 4xx status.

Every route but ``/health`` needs the run's token (:class:`~miles_contracts.wire.guard.RequestGuard`
in front of the app); :data:`ROUTER_ROUTES` lists the router's own routes by kind. Forwarded
requests go to the engines with the router's token, never the caller's ``Authorization`` header.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from miles import bounded_json
from miles_contracts import RouterRequest, RouterResponse
from miles_contracts.wire.auth import ensure_run_token
from miles_contracts.wire.engine import CONTROL, HEALTH, ROUTING_KEY_HEADER
from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard

from miles_router.aborts import router_abort
from miles_router.adapters import served_adapters
from miles_router.config import RouterSection
from miles_router.fleet import UnknownWorker
from miles_router.middleware import STATE_QUERY, NamedMiddleware, build_middlewares
from miles_router.router import Router
from miles_router.workers import InvalidWorkerUrl

if TYPE_CHECKING:
    from miles_contracts import RunContext

log = logging.getLogger(__name__)

ROUTER_ROUTES: dict[str, str] = {
    "/health": HEALTH,
    "/add_worker": CONTROL,
    "/remove_worker": CONTROL,
    "/list_workers": CONTROL,
    "/metrics": CONTROL,
}
"""The router's own routes by kind; every other path is forwarded to engines (fan-out paths are
engine control routes, the rest data routes: see ``miles_contracts.wire.engine.ENGINE_ROUTES``)."""

_PER_ENGINE_ONLY = {
    "/init_weights_update_group": "each engine needs its own rank_offset in the weight-update group",
}


def create_app(section: RouterSection | None = None, workers: Sequence[str] = (),
               middlewares: Sequence[NamedMiddleware] | None = None, *, ctx: RunContext | None = None,
               auth_token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               allowed_hosts: Sequence[str] = ()) -> FastAPI:
    """The router app. ``middlewares`` defaults to those ``section.middlewares`` names, built by
    the specs ``ctx.kernel`` registers with ``section.middleware_options`` (a section that names
    middlewares needs one of the two). ``auth_token`` (default the run's, ``MILES_AUTH_TOKEN``, made
    and set there when unset) is what callers must send and what the router sends to its engines;
    ``allowed_hosts`` are host names the guard accepts besides addresses and ``localhost``. With
    ``ctx`` of a ``train.lora`` run on SGLang, requests name their engine's adapter
    (:mod:`miles_router.adapters`)."""
    section = section or RouterSection()
    if middlewares is None:
        if section.middlewares and ctx is None:
            raise ValueError(f"router.middlewares {section.middlewares} needs the run context whose kernel registers "
                             "them: pass ctx= (or the built chain as middlewares=)")
        middlewares = build_middlewares(section.middlewares, section.middleware_options, ctx) if ctx else []
    token = auth_token or ensure_run_token()
    router = Router(section, workers, middlewares, auth_token=token,
                    adapters=served_adapters(ctx.config) if ctx is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="miles router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    app.add_middleware(RequestGuard, token=token, public_paths=[p for p, kind in ROUTER_ROUTES.items() if kind == HEALTH],
                       max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts)

    @app.post("/add_worker")
    async def add_worker(request: Request) -> JSONResponse:
        url = await _worker_url(request, "add_worker")
        if isinstance(url, JSONResponse):
            return url
        try:
            worker, added = await router.add_worker(url)
        except InvalidWorkerUrl as exc:
            return _error(400, str(exc))
        message = (f"worker {worker.url} added ({worker.state.value})" if added
                   else f"worker {worker.url} was already registered ({worker.state.value}); nothing changed")
        return JSONResponse({"added": added, "message": message, "worker": worker.describe()})

    @app.post("/remove_worker")
    async def remove_worker(request: Request) -> JSONResponse:
        url = await _worker_url(request, "remove_worker")
        if isinstance(url, JSONResponse):
            return url
        try:
            worker = router.remove_worker(url)
        except InvalidWorkerUrl as exc:
            return _error(400, str(exc))
        except UnknownWorker as exc:
            return _error(404, str(exc))
        return JSONResponse({"removed": True, "message": f"worker {worker.url} removed",
                             "worker": worker.describe()})

    @app.get("/list_workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse(router.list_workers())

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = router.health()
        public = {"status": body["status"]}  # no counts, versions or reasons: /list_workers has them
        if body["status"] == "paused":
            public["message"] = "every worker is paused (a weight sync); requests wait until they continue"
        elif not ok:
            public["message"] = ("no worker can serve requests now: GET /list_workers (with the run's token) says "
                                 "why; add one with POST /add_worker?url=...")
        return JSONResponse(public, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(format: str = "json") -> Response:
        if format == "prometheus":
            return PlainTextResponse(router.prometheus(), media_type="text/plain; version=0.0.4")
        if format != "json":
            return _error(400, f"unknown metrics format {format!r}; "
                               "use format=json (default) or format=prometheus")
        return JSONResponse(router.metrics())

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, request: Request) -> Response:
        path = "/" + path
        if path in _PER_ENGINE_ONLY:
            return _error(400, f"the router does not forward {path}: {_PER_ENGINE_ONLY[path]}; call each engine "
                               "directly (GET /list_workers gives their URLs)")
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        headers = dict(request.headers)
        routed = RouterRequest(method=request.method, path=path, body=body, headers=headers,
                               routing_key=headers.get(ROUTING_KEY_HEADER.lower()) or None,
                               state={STATE_QUERY: request.url.query})
        try:
            response = await router.handle(routed)
        except Exception as exc:  # a failing middleware must still give the caller an answer
            log.exception("router failed on %s %s", request.method, path)
            response = router_abort(routed, "router_error", f"router error: {type(exc).__name__}: {exc}")
        return _to_http(response)

    return app


async def _json_body(request: Request) -> dict[str, Any] | None | JSONResponse:
    raw = await request.body()
    if not raw.strip():
        return None
    try:
        body = bounded_json.loads(raw)
    except bounded_json.NestedTooDeep as exc:
        return _error(400, f"request body refused: {exc}; no engine request needs that many")
    except ValueError as exc:
        return _error(400, f"request body is not valid JSON ({exc}); send a JSON object")
    if not isinstance(body, dict):
        return _error(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def _worker_url(request: Request, endpoint: str) -> str | JSONResponse:
    url = request.query_params.get("url")
    if url is None:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        url = (body or {}).get("url")
    if not url:
        return _error(400, f"give the worker URL: POST /{endpoint}?url=http://HOST:PORT or a JSON body "
                           '{"url": "http://HOST:PORT"}')
    return url


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _to_http(response: RouterResponse) -> Response:
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-type"}
    media_type = response.headers.get("content-type")
    body = response.body
    if hasattr(body, "__aiter__"):
        return StreamingResponse(body, status_code=response.status_code, headers=headers, media_type=media_type)
    if isinstance(body, bytes | str):
        return Response(body, status_code=response.status_code, headers=headers, media_type=media_type)
    return JSONResponse(body, status_code=response.status_code, headers=headers)
