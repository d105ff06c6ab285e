"""The engine's HTTP API: SGLang's native endpoints, with SGLang's paths, request fields, status
codes and answers (``miles_contracts.wire.engine``; the contract suite
``miles_contracts.testing.engine`` runs against this server and a real SGLang server alike), plus
Miles' own: two check-mode endpoints (``/fill_weights_noise``, ``/weights_checksum``) and
``/update_weights_from_mooncake`` (``miles_contracts.wire.mooncake``).

``create_app(engine)`` serves an :class:`~miles_engine.engine.Engine` it does not own; the caller
starts and shuts the engine down (``miles serve engine`` does both). Every error is a JSON body
``{"detail": "<what was wrong and how to fix it>"}``: 400 for a bad request (unknown field,
negative ``max_new_tokens``, prompt beyond the context, token ids outside the vocabulary ...),
503 when the engine cannot serve. Weight updates answer ``{"success": bool, "message": str}``
with 200 or 400, as SGLang does.

In front of everything sits :class:`~miles_contracts.wire.guard.RequestGuard`: every route but
``/health`` needs the run's token, bodies are JSON and bounded, cross-origin requests are refused.
Routes are listed by kind (health, data, control) in
:data:`miles_contracts.wire.engine.ENGINE_ROUTES`; ``/health`` answers 503 while the engine is
paused, so a router sends its work elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from miles_contracts.wire.auth import ensure_run_token
from miles_contracts.wire.engine import (
    ENGINE_ROUTES,
    HEALTH,
    AbortRequest,
    CheckWeightsRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard
from miles_contracts.wire.mooncake import MOONCAKE_PATH, UpdateWeightsFromMooncakeRequest
from pydantic import BaseModel, ValidationError

from miles_engine.checker import WeightCheckFailed
from miles_engine.engine import BadRequestError, Engine
from miles_engine.memory import MemoryStateError
from miles_engine.openapi import FillWeightsNoiseRequest, engine_openapi
from miles_engine.weights import WeightUpdateError

log = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 60.0
INLINE_VALIDATE_BYTES = 1 << 20
"""``/generate`` bodies up to this size are validated on the event loop; larger ones in a thread."""


def create_app(engine: Engine, *, auth_token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               allowed_hosts: Sequence[str] = ()) -> RequestGuard:
    """The ASGI app: the request guard, then ``POST /generate`` on :class:`GenerateFastPath`, every
    other route on FastAPI. ``auth_token`` defaults to the run's (``MILES_AUTH_TOKEN``; a new one is
    set there when it is unset, so this process's clients and children share it); ``allowed_hosts``
    are host names the guard accepts besides addresses and ``localhost``."""
    token = auth_token or ensure_run_token()
    public = [path for path, kind in ENGINE_ROUTES.items() if kind == HEALTH]
    return RequestGuard(GenerateFastPath(_fastapi_app(engine), engine), token=token, public_paths=public,
                        max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts)


def _fastapi_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="miles embedded engine", docs_url=None, redoc_url=None)
    schema = engine_openapi()
    app.openapi = lambda: schema  # type: ignore[method-assign]  # the routes' real bodies (see openapi.py)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _describe(exc.errors())}, status_code=400)

    @app.exception_handler(BadRequestError)
    async def _bad(request: Request, exc: BadRequestError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    # POST /generate is served by GenerateFastPath in front of this app

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        body = await _parse(request, AbortRequest)
        if not body.abort_all and not body.rid:
            raise BadRequestError("give a 'rid' to abort, or \"abort_all\": true")
        await engine.abort(None if body.abort_all else body.rid)
        return Response(status_code=200)  # SGLang answers an empty 200

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        body = await _parse(request, PauseGenerationRequest, allow_empty=True)
        await engine.pause(body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Any:
        await _parse(request, ContinueGenerationRequest, allow_empty=True)
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        if await engine.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are queued or running (pause with mode 'abort', or "
                                 "wait for them).\n", status_code=400)

    @app.get("/health")
    async def health() -> Any:
        return _health(engine)

    @app.get("/health_generate")
    async def health_generate() -> Any:
        if engine.scheduler.held or not engine.scheduler.alive:
            return _health(engine)
        probe = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(engine.generate(probe), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            return JSONResponse({"detail": f"generation probe failed: {exc or 'timeout'}"}, status_code=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name, still served by 0.5.13
    async def model_info() -> Any:
        return engine.model_info().model_dump(mode="json")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Any:
        return engine.server_info()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Any:
        body = await _parse(request, UpdateWeightsFromDiskRequest)
        return await _update(engine, lambda: engine.weights.from_disk(body))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Any:
        if not _is_loopback(request):  # shared memory and CUDA IPC handles exist on this host only
            return JSONResponse({"success": False, "message": "update_weights_from_tensor is accepted from "
                                 "loopback clients only; use update_weights_from_distributed across hosts"},
                                status_code=403)
        body = await _parse(request, UpdateWeightsFromTensorRequest)
        return await _update(engine, lambda: engine.weights.from_tensor(body))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> Any:
        body = await _parse(request, InitWeightsUpdateGroupRequest)
        return await _update(engine, lambda: engine.weights.init_group(body), done="joined weight update group")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> Any:
        body = await _parse(request, DestroyWeightsUpdateGroupRequest, allow_empty=True)

        async def destroy() -> None:
            engine.weights.destroy_group(body.group_name)

        return await _update(engine, destroy, done="weight update group destroyed")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> Any:
        body = await _parse(request, UpdateWeightsFromDistributedRequest)
        return await _update(engine, lambda: engine.weights.from_distributed(body))

    @app.post(MOONCAKE_PATH)
    async def update_weights_from_mooncake(request: Request) -> Any:
        body = await _parse(request, UpdateWeightsFromMooncakeRequest)
        return await _update(engine, lambda: engine.weights.from_mooncake(body))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await _parse(request, UpdateWeightVersionRequest)
        answer = await _update(engine, lambda: engine.weights.set_version(body.new_version, abort_all=body.abort_all_requests),
                               done=f"Weight version updated to {body.new_version}")
        return answer if isinstance(answer, JSONResponse) else {**answer, "new_version": body.new_version}

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request) -> Any:
        body = await _parse(request, CheckWeightsRequest, allow_empty=True)
        try:
            extra = await engine.weights.check(body.action)
        except (WeightUpdateError, WeightCheckFailed) as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return {"success": True, "message": "Success.", **extra}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Any:
        body = await _parse(request, MemoryOccupationRequest, allow_empty=True)
        return await _memory(engine.release_memory, body.tags)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Any:
        body = await _parse(request, MemoryOccupationRequest, allow_empty=True)
        return await _memory(engine.resume_memory, body.tags)

    @app.post("/fill_weights_noise")
    async def fill_weights_noise(request: Request) -> Any:
        body = await _parse(request, FillWeightsNoiseRequest)
        return await _update(engine, lambda: engine.weights.fill_noise(body.seed), done="weights filled with noise")

    @app.get("/weights_checksum")
    async def weights_checksum() -> Any:
        checksums = await engine.weights.checksums()
        return {"weight_version": engine.weight_version, "checksums": checksums}

    return app


class GenerateFastPath:
    """``POST /generate`` served on plain ASGI; every other request goes to the FastAPI app.

    A rollout step sends hundreds of ``/generate`` calls at once, and the engine's HTTP thread
    shares the GIL with the scheduler. On the H200 learning run (py-spy, all processes), FastAPI's
    routing, dependency and response layers were about half of that thread's CPU per request.
    Validation, status codes and bodies are the FastAPI route's: 400 ``{"detail": ...}`` for a bad
    request (the same message), the result as compact JSON, 499 when the client went away (its
    request is aborted and its batch slot freed); an unexpected engine error is a 500 with a
    ``detail`` instead of FastAPI's plain-text one.
    """

    def __init__(self, app: FastAPI, engine: Engine) -> None:
        self.fastapi = app
        self.engine = engine

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.fastapi(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            if len(body) > INLINE_VALIDATE_BYTES:  # keep the event loop (and /health) responsive
                request = await asyncio.to_thread(GenerateRequest.model_validate_json, body)
            else:
                request = GenerateRequest.model_validate_json(body)
        except ValidationError as exc:
            await _send_json(send, 400, {"detail": _describe(exc.errors())})
            return
        task = asyncio.ensure_future(self.engine.generate(request))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # the client went away (or we are being cancelled): abort, free the slot
            gone.cancel()
        if not task.done() or task.cancelled():
            with contextlib.suppress(Exception):  # nobody may be listening any more
                await _send_json(send, 499, {"detail": "client disconnected"})
            return
        error = task.exception()
        if isinstance(error, BadRequestError):
            await _send_json(send, 400, {"detail": str(error)})
        elif error is not None:
            log.error("generate failed", exc_info=error)
            await _send_json(send, 500, {"detail": f"engine error: {type(error).__name__}: {error}"})
        else:
            await _send_json(send, 200, task.result().model_dump(mode="json", exclude_none=True))


async def _disconnected(receive: Any) -> None:
    """Returns once the client has gone away (ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Any, status: int, content: Any) -> None:
    # the bytes FastAPI's JSONResponse would send
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _parse(request: Request, model: type[BaseModel], *, allow_empty: bool = False) -> Any:
    """Validate a JSON body ourselves where FastAPI's body binding would not give a clear 400."""
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return model()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequestError(_describe(exc.errors())) from None


async def _update(engine: Engine, run: Any, done: str = "weights updated") -> Any:
    try:
        result = await run()
    except WeightUpdateError as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
    except Exception as exc:  # a failed load or collective: report it, keep serving
        log.exception("weight operation failed")
        return JSONResponse({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status_code=500)
    message = f"{done} ({result} tensors)" if isinstance(result, int) else done
    return {"success": True, "message": message}


async def _memory(run: Any, tags: list[str] | None) -> Any:
    try:
        await run(tags)
    except MemoryStateError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    return Response(status_code=200)


def _describe(errors: Any) -> str:
    parts = []
    for error in errors:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        kind = error.get("type", "")
        message = "unknown field; check the spelling against the API" if kind == "extra_forbidden" else error.get("msg", "")
        parts.append(f"{where}: {message}")
    return "invalid request: " + "; ".join(parts)


def _health(engine: Engine) -> Any:
    """200 only when a request sent now would be served: not while paused (a weight sync, or an
    operator's ``/pause_generation``), so a router sends new work to other engines meanwhile."""
    if not engine.scheduler.alive:
        return JSONResponse({"status": "stopped", "detail": "the scheduler thread is not running"}, status_code=503)
    if engine.paused:
        return JSONResponse({"status": "paused", "detail": "generation is paused; POST /continue_generation "
                             "resumes it", "weight_version": engine.weight_version}, status_code=503)
    if engine.scheduler.held:
        return JSONResponse({"status": "paused", "reason": "memory_released", "detail": "memory is released; POST "
                             "/resume_memory_occupation takes it back", "weight_version": engine.weight_version},
                            status_code=503)
    return {"status": "ok"}


def _is_loopback(request: Request) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(request.client.host if request.client else "").is_loopback
    except ValueError:  # not an address (a test client's "testclient", a Unix socket)
        return False
