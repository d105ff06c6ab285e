"""The session server's OpenAPI document (``GET /openapi.json``), from its request models.

The server is plain ASGI (see ``app.py``), so nothing generates this for it; the paths here are
the routes of :class:`~miles_tito.server.app.SessionApp`, and the test suite fuzzes the server
against this document with schemathesis (``tests/security/test_fuzz.py``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from miles_contracts.wire.session import ChildSessionRequest, CreateSessionRequest

from miles_tito.server.messages_request import MessagesRequest
from miles_tito.server.responses_request import ResponsesRequest
from miles_tito.server.schema import ChatCompletionRequest

_REF = "#/components/schemas/{model}"
_SESSION_ID = {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}


@cache
def session_openapi() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (CreateSessionRequest, ChildSessionRequest, ChatCompletionRequest, MessagesRequest, ResponsesRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema

    def body(model: type, required: bool) -> dict[str, Any]:
        return {"required": required, "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}

    def answers(*statuses: str) -> dict[str, Any]:
        described = {"200": "done", "400": "invalid request (OpenAI error body)", "401": "missing or wrong token",
                     "404": "no such session (or parent turn)", "409": "session closing",
                     "413": "body over the size limit", "415": "body is not JSON",
                     "422": "the chat template breaks token-in-token-out", "502": "the engine failed",
                     "503": "the engine aborted the generation"}
        return {s: {"description": described[s]} for s in statuses}

    paths = {
        "/health": {"get": {"summary": "liveness", "operationId": "health", "security": [], "responses": answers("200")}},
        "/server_info": {"get": {"summary": "model, chat family, stop token ids and open sessions",
                                 "operationId": "server_info", "responses": answers("200", "401")}},
        "/openapi.json": {"get": {"summary": "this document", "operationId": "openapi", "responses": answers("200", "401")}},
        "/sessions": {"post": {"summary": "open a session", "operationId": "create_session",
                               "requestBody": body(CreateSessionRequest, False),
                               "responses": answers("200", "400", "401", "404", "413", "415")}},
        "/sessions/{session_id}": {
            "parameters": [_SESSION_ID],
            "get": {"summary": "the session's records", "operationId": "get_session", "responses": answers("200", "401", "404")},
            "delete": {"summary": "close the session, returning its final records", "operationId": "delete_session",
                       "responses": answers("200", "401", "404")},
        },
        "/sessions/{session_id}/v1/children": {
            "parameters": [_SESSION_ID],
            "post": {"summary": "open a sub-agent's session in this session's episode (the session's key suffices)",
                     "operationId": "create_child", "requestBody": body(ChildSessionRequest, False),
                     "responses": answers("200", "400", "401", "404", "409", "413", "415")},
        },
        "/sessions/{session_id}/v1/models": {
            "parameters": [_SESSION_ID],
            "get": {"summary": "the served model", "operationId": "models", "responses": answers("200", "401", "404")},
        },
        "/sessions/{session_id}/v1/chat/completions": {
            "parameters": [_SESSION_ID],
            "post": {"summary": "OpenAI chat completion in the session", "operationId": "chat_completions",
                     "requestBody": body(ChatCompletionRequest, True),
                     "responses": answers("200", "400", "401", "404", "409", "413", "415", "422", "502", "503")},
        },
        "/sessions/{session_id}/v1/messages": {
            "parameters": [_SESSION_ID],
            "post": {"summary": "Anthropic Messages in the session (Anthropic error bodies)", "operationId": "messages",
                     "requestBody": body(MessagesRequest, True),
                     "responses": answers("200", "400", "401", "404", "409", "413", "415", "422", "502", "503")},
        },
        "/sessions/{session_id}/v1/responses": {
            "parameters": [_SESSION_ID],
            "post": {"summary": "OpenAI Responses in the session", "operationId": "responses",
                     "requestBody": body(ResponsesRequest, True),
                     "responses": answers("200", "400", "401", "404", "409", "413", "415", "422", "502", "503")},
        },
    }
    return {
        "openapi": "3.1.0", "info": {"title": "miles session server", "version": "0.1.0"}, "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
