"""The session server's HTTP API: a plain ASGI app, served by uvicorn.

``POST   /sessions``                             create; body :class:`CreateSessionRequest` (optional)
``POST   /sessions/{id}/v1/chat/completions``    OpenAI chat completions (tools, streaming accepted)
``POST   /sessions/{id}/v1/messages``            Anthropic Messages (tools, thinking, streaming accepted)
``POST   /sessions/{id}/v1/responses``           OpenAI Responses (tools, reasoning, previous_response_id, streaming)
``POST   /sessions/{id}/v1/children``            a sub-agent's session in the same episode (the session's key suffices)
``GET    /sessions/{id}/v1/models``              the served model (some clients ask first)
``GET    /sessions/{id}``                        :class:`SessionView`: records with exact token ids
``DELETE /sessions/{id}``                        waits for the request in flight, returns the final view
``GET    /health``                               liveness only: ``{"status": "ok"}``, to anyone
``GET    /server_info``                          model, chat family, stop ids, open sessions
``GET    /openapi.json``                         this API as OpenAPI 3.1

Every route but ``/health`` needs the run's token (``Authorization: Bearer $MILES_AUTH_TOKEN``;
:class:`~miles_contracts.wire.guard.RequestGuard` in front of the app, which also bounds bodies,
requires JSON and refuses cross-origin requests). A session's own model routes
(``/sessions/{id}/v1/...``) also take that session's ``api_key``, returned by ``POST /sessions``:
an agent holds a key that reaches its own session and nothing else, and passes it the ordinary way,
``AsyncOpenAI(base_url=base_url, api_key=api_key)``, or as Anthropic's SDKs do, in ``x-api-key``:
``Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key)`` (that SDK appends
``/v1/messages`` itself).

That ``base_url`` (and the ``Location`` of a redirect) names the address the request arrived on,
the socket's own (uvicorn's ``scope["server"]``), never the ``Host`` header: a client writes that
header, and an agent that follows a URL built from it sends its session key wherever it pointed.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) with the status
codes of :mod:`miles_tito.errors`; the Messages route answers Anthropic's shape
(``{"type": "error", "error": {"type", "message", ...}}``), and the guard's refusals carry both
(``"type": "error"`` beside an ``error`` object with all four keys), since the guard answers before
any route is chosen. Deterministic errors carry ``x-should-retry: false`` so the
SDKs do not retry them; an engine abort carries ``true``. Unknown paths and methods answer as they
did under FastAPI (``{"detail":"Not Found"}`` 404, ``{"detail":"Method Not Allowed"}`` 405 with
``Allow``, a 307 to the path without or with a trailing slash where that one exists); an unexpected
exception answers a plain-text 500 and is re-raised for uvicorn to log.

Why no web framework: the session server sits on every agent turn, and a profile put about a
quarter of its CPU per request in FastAPI's and Starlette's routing, middleware stack and
dependency solving, none of which this API uses (a few routes, JSON bodies read by hand, no OpenAPI).
Here a request costs one dictionary look-up to route and two ``send`` calls to answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles import bounded_json
from miles_contracts.wire.auth import ensure_run_token
from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard

from miles_tito.errors import EngineAborted, InvalidRequest, TitoError
from miles_tito.server import messages_response, responses_response
from miles_tito.server.openapi import session_openapi
from miles_tito.server.responses import completion, error_body, stream_events
from miles_tito.server.service import Session, SessionService

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = b"application/json"
_EVENT_STREAM = b"text/event-stream; charset=utf-8"
_NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's bodies, byte for byte
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'


@dataclass(slots=True)
class Reply:
    """What a handler answers: a whole body, or ``chunks`` sent as they come (server-sent events)."""

    body: bytes = b""
    status: int = 200
    content_type: bytes = _JSON
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: Iterable[bytes] | None = None


def json_reply(body: Any, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> Reply:
    return Reply(json.dumps(body, ensure_ascii=False).encode(), status, _JSON, headers or [])


@dataclass(slots=True)
class Call:
    """One request as handlers see it: the path's session id, the body on demand, the ASGI scope."""

    scope: Scope
    receive: Receive
    session_id: str = ""

    async def body(self) -> bytes:
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def json(self, *, optional: bool = False) -> Any:
        raw = await self.body()
        if not raw.strip():
            if optional:
                return None
            raise InvalidRequest("the request body is empty; send a JSON object")
        try:
            return bounded_json.loads(raw)
        except bounded_json.NestedTooDeep as exc:
            raise InvalidRequest(f"the request body is refused: {exc}") from None
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at char {exc.pos}") from None
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: not UTF-8 ({exc.reason})") from None

    def base_url(self) -> str:
        """This server's URL at the address the request arrived on (see the module docstring)."""
        return server_url(self.scope)


class _ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


Handler = Callable[[Call], Awaitable[Reply]]


class SessionApp:
    """The ASGI application; ``service`` holds the sessions."""

    def __init__(self, service: SessionService) -> None:
        self.service = service
        # Routes by path shape: the path's segments, with the session id's segment as "*".
        self._routes: dict[tuple[str, ...], dict[str, Handler]] = {
            ("health",): {"GET": self.health},
            ("server_info",): {"GET": self.server_info},
            ("openapi.json",): {"GET": self.openapi},
            ("sessions",): {"POST": self.create_session},
            ("sessions", "*"): {"GET": self.get_session, "DELETE": self.delete_session},
            ("sessions", "*", "v1", "children"): {"POST": self.create_child},
            ("sessions", "*", "v1", "models"): {"GET": self.models},
            ("sessions", "*", "v1", "chat", "completions"): {"POST": self.chat_completions},
            ("sessions", "*", "v1", "messages"): {"POST": self.messages},
            ("sessions", "*", "v1", "responses"): {"POST": self.responses},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await acknowledge_lifespan(receive, send)
        # websocket: returning without accepting makes uvicorn refuse it (403)

    # ------------------------------------------------------------------ endpoints

    async def health(self, call: Call) -> Reply:
        """Public: says the server answers, and nothing about what it serves."""
        return json_reply({"status": "ok"})

    async def server_info(self, call: Call) -> Reply:
        service = self.service
        return json_reply({
            "sessions": len(service.sessions), "family": service.tito.family.name,
            "model": service.model_name, "stop_token_ids": service.tito.stop_token_ids,
        })

    async def openapi(self, call: Call) -> Reply:
        return json_reply(session_openapi())

    async def create_session(self, call: Call) -> Reply:
        return _created(self.service.create(await call.json(optional=True)), call)

    async def create_child(self, call: Call) -> Reply:
        return _created(self.service.create_child(call.session_id, await call.json(optional=True)), call)

    async def get_session(self, call: Call) -> Reply:
        service = self.service
        return _model_reply(service.view(service.get(call.session_id)))

    async def delete_session(self, call: Call) -> Reply:
        return _model_reply(await self.service.delete(call.session_id))

    async def models(self, call: Call) -> Reply:
        self.service.get(call.session_id)
        return json_reply({"object": "list", "data": [{"id": self.service.model_name, "object": "model", "owned_by": "miles"}]})

    async def chat_completions(self, call: Call) -> Reply:
        service = self.service
        outcome = await service.chat(call.session_id, await call.json())
        if outcome.request.stream:
            events = stream_events(outcome.result, outcome.request, model=service.model_name, tito=service.tito)
            return Reply(content_type=_EVENT_STREAM, chunks=events)
        return json_reply(completion(outcome.result, outcome.request, model=service.model_name, tito=service.tito))

    async def messages(self, call: Call) -> Reply:
        service = self.service
        try:
            outcome = await service.messages(call.session_id, await call.json())
        except TitoError as error:  # Anthropic's error shape on Anthropic's route
            return json_reply(messages_response.error_body(error), error.status_code, _retry_header(error))
        if outcome.request.stream:
            return Reply(content_type=_EVENT_STREAM, chunks=messages_response.stream_events(outcome.result, model=service.model_name))
        return json_reply(messages_response.message(outcome.result, model=service.model_name))

    async def responses(self, call: Call) -> Reply:
        service = self.service
        outcome = await service.responses(call.session_id, await call.json())
        answer = {"response_id": outcome.response_id, "model": service.model_name}
        if outcome.request.stream:
            return Reply(content_type=_EVENT_STREAM,
                         chunks=responses_response.stream_events(outcome.result, outcome.request, **answer))
        return json_reply(responses_response.response(outcome.result, outcome.request, **answer))

    # ------------------------------------------------------------------ plumbing

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            reply = await self._dispatch(scope, receive)
            await _send_reply(reply, tracked)
        except _ClientGone:
            return
        except Exception:
            if not started:  # as Starlette's ServerErrorMiddleware: a plain 500, then uvicorn logs the error
                await _send_reply(Reply(b"Internal Server Error", 500, b"text/plain; charset=utf-8"), send)
            raise

    async def _dispatch(self, scope: Scope, receive: Receive) -> Reply:
        path: str = scope["path"]
        route, session_id = self._match(path)
        if route is None:
            return _redirect_or_404(scope, self._match)
        handler = route.get(scope["method"])
        if handler is None:
            return Reply(_METHOD_NOT_ALLOWED, 405, _JSON, [(b"allow", ", ".join(route).encode())])
        try:
            return await handler(Call(scope, receive, session_id))
        except TitoError as error:
            return json_reply(error_body(error), error.status_code, _retry_header(error))

    def _match(self, path: str) -> tuple[dict[str, Handler] | None, str]:
        parts = path.split("/")
        if parts[0] or len(parts) < 2:
            return None, ""
        parts = parts[1:]
        session_id = ""
        if len(parts) > 1 and parts[0] == "sessions":
            session_id, parts[1] = parts[1], "*"
            if not session_id:
                return None, ""
        return self._routes.get(tuple(parts)), session_id


def create_app(service: SessionService, *, auth_token: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts: Sequence[str] = ()) -> RequestGuard:
    """The session server behind the request guard. ``auth_token`` defaults to the run's
    (``MILES_AUTH_TOKEN``, made and set there when unset); ``allowed_hosts`` are host names the guard
    accepts besides addresses and ``localhost``."""
    return RequestGuard(SessionApp(service), token=auth_token or ensure_run_token(), public_paths=["/health"],
                        max_body_bytes=max_body_bytes, also_accept=service.accepts_session_key,
                        key_headers=["x-api-key"], error_body=_guard_error, allowed_hosts=allowed_hosts)


def _guard_error(status: int, message: str) -> bytes:
    """One body both SDKs read: OpenAI's (``error.message``, ``error.code``) and Anthropic's
    (``type: error``, ``error.type``), for the guard answers before it knows which API a path is."""
    code = {400: "host_not_allowed", 401: "invalid_api_key", 403: "cross_origin", 413: "request_too_large",
            415: "unsupported_media_type"}
    kind = {401: "authentication_error", 403: "permission_error", 413: "request_too_large"}
    body = {"type": "error", "error": {"message": message, "type": kind.get(status, "invalid_request_error"),
                                       "param": None, "code": code.get(status)}}
    return json.dumps(body).encode()


def _retry_header(error: TitoError) -> list[tuple[bytes, bytes]]:
    """``x-should-retry``, which OpenAI's and Anthropic's SDKs both obey: only an engine abort is
    worth retrying as it is."""
    return [(b"x-should-retry", b"true" if isinstance(error, EngineAborted) else b"false")]


def _created(session: Session, call: Call) -> Reply:
    return json_reply({"session_id": session.id, "base_url": f"{call.base_url()}/sessions/{session.id}/v1",
                       "api_key": session.api_key, "episode_id": session.conversation.episode.id})


def _model_reply(model: Any) -> Reply:
    return json_reply(model.model_dump(mode="json"))


def server_url(scope: Scope) -> str:
    """``http://<address>:<port>`` of the socket the request arrived on."""
    host, port = scope["server"]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return f"{scope.get('scheme', 'http')}://{host}:{port}"


def _redirect_or_404(scope: Scope, match: Callable[[str], tuple[Any, str]]) -> Reply:
    """Starlette's ``redirect_slashes``: the same path with the trailing slash toggled, if that one
    exists, at this server's own address."""
    path: str = scope["path"]
    if path != "/":
        other = path[:-1] if path.endswith("/") else path + "/"
        if match(other)[0] is not None:
            query = scope.get("query_string", b"")
            location = f"{server_url(scope)}{other}".encode("latin-1") + (b"?" + query if query else b"")
            return Reply(b"", 307, b"", [(b"location", location)])
    return Reply(_NOT_FOUND, 404)


async def _send_reply(reply: Reply, send: Send) -> None:
    headers = [(b"content-type", reply.content_type)] if reply.content_type else []
    if reply.chunks is None:
        headers.append((b"content-length", str(len(reply.body)).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers + reply.headers})
        await send({"type": "http.response.body", "body": reply.body})
        return
    await send({"type": "http.response.start", "status": reply.status, "headers": headers + reply.headers})
    for chunk in reply.chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def acknowledge_lifespan(receive: Receive, send: Send) -> None:
    """Nothing to start or stop: acknowledge both, so uvicorn does not report lifespan as unsupported."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
