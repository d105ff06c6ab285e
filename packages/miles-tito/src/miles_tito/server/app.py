"""The session server's HTTP API (FastAPI).

``POST   /sessions``                             create; body :class:`CreateSessionRequest` (optional)
``POST   /sessions/{id}/v1/chat/completions``    OpenAI chat completions (tools, streaming accepted)
``GET    /sessions/{id}/v1/models``              the served model (some clients ask first)
``GET    /sessions/{id}``                        :class:`SessionView`: records with exact token ids
``DELETE /sessions/{id}``                        waits for the request in flight, returns the final view
``GET    /health``

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) with the status
codes of :mod:`miles_tito.errors`. Deterministic errors carry ``x-should-retry: false`` so OpenAI
SDKs do not retry them; an engine abort carries ``true``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from miles_tito.errors import EngineAborted, InvalidRequest, TitoError
from miles_tito.server.responses import completion, error_body, stream_events
from miles_tito.server.service import SessionService


def _json(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status_code=status_code, media_type="application/json", headers=headers)


async def _body(request: Request, *, optional: bool = False) -> Any:
    raw = await request.body()
    if not raw.strip():
        if optional:
            return None
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at char {exc.pos}") from None


def create_app(service: SessionService) -> FastAPI:
    app = FastAPI(title="Miles session server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(TitoError)
    async def _tito_error(_: Request, error: TitoError) -> Response:
        retry = "true" if isinstance(error, EngineAborted) else "false"
        return _json(error_body(error), error.status_code, headers={"x-should-retry": retry})

    @app.get("/health")
    async def health() -> Response:
        return _json({
            "status": "ok", "sessions": len(service.sessions), "family": service.tito.family.name,
            "model": service.model_name, "stop_token_ids": service.tito.stop_token_ids,
        })

    @app.post("/sessions")
    async def create_session(request: Request) -> Response:
        session = service.create(await _body(request, optional=True))
        base_url = f"{str(request.base_url).rstrip('/')}/sessions/{session.id}/v1"
        return _json({"session_id": session.id, "base_url": base_url})

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str) -> Response:
        return _json(service.view(service.get(session_id)).model_dump(mode="json"))

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> Response:
        return _json((await service.delete(session_id)).model_dump(mode="json"))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> Response:
        service.get(session_id)
        return _json({"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "miles"}]})

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Response:
        outcome = await service.chat(session_id, await _body(request))
        if outcome.request.stream:
            events = stream_events(outcome.result, outcome.request, model=service.model_name, tito=service.tito)
            return StreamingResponse(events, media_type="text/event-stream")
        return _json(completion(outcome.result, outcome.request, model=service.model_name, tito=service.tito))

    return app
