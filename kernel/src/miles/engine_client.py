"""Async HTTP client for the engine wire protocol (an engine or the router in front of engines).

It runs on :mod:`miles.http11`, a lean keep-alive HTTP/1.1 client, not httpx: the session server
and the rollout make one call here per generated turn, and httpx's per-request machinery was the
largest single cost of the session server (see ``docs/benchmarks/session.md``). Request and
response bodies are (de)serialised by pydantic's Rust core straight from and to bytes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from miles_contracts.wire.engine import ROUTING_KEY_HEADER, GenerateRequest, GenerateResponse

from miles.errors import MilesError
from miles.http11 import (
    ConnectFailed,
    ConnectionLost,
    HttpClient,
    HttpError,
    HttpResponse,
    ProtocolError,
    ResponseTimeout,
)

_JSON = {"Content-Type": "application/json"}
_RETRIED = (ConnectFailed, ConnectionLost, ProtocolError)
"""Failures where the request never got an answer: worth another try (the router may be restarting)."""


class EngineRequestError(MilesError):
    """The engine answered with an error status (the message carries its detail)."""

    def __init__(self, status_code: int, detail: str) -> None:
        self.status_code = status_code
        super().__init__(f"engine returned HTTP {status_code}: {detail}")


class EngineUnavailableError(MilesError):
    """The engine (or router) could not be reached or did not answer in time."""


class HttpEngineClient:
    """``await client.generate(request, routing_key=...)`` against ``base_url``.

    Connection errors are retried ``retries`` times with a short back-off (the router fails over
    between engines itself; this covers the router restarting). HTTP errors and timeouts are not
    retried. Requests carry the run's token (``auth_token``, default ``MILES_AUTH_TOKEN``).
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0, retries: int = 2, max_connections: int = 512,
                 auth_token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._client = HttpClient(self.base_url, timeout=timeout, connect_timeout=10.0, max_connections=max_connections,
                                  auth_token=auth_token)

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        """Raises ``pydantic.ValidationError`` if the answer is not a generate response."""
        body = request.model_dump_json(exclude_none=True).encode()
        response = await self._send("POST", "/generate", body, routing_key)
        return GenerateResponse.model_validate_json(response.body)

    async def post(self, path: str, body: dict[str, Any] | None = None, *, routing_key: str | None = None) -> Any:
        data = json.dumps(body or {}, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()  # as httpx's json=
        return (await self._send("POST", path, data, routing_key)).json()

    async def control(self, path: str, body: dict[str, Any] | None = None) -> str:
        """POST a control call (pause, flush, memory release ...) and return the answer's text:
        engines answer these with JSON, plain text or an empty body (SGLang's ``/flush_cache``,
        the memory routes), so none is parsed. An error status raises :class:`EngineRequestError`."""
        data = json.dumps(body or {}, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        return (await self._send("POST", path, data, None)).text

    async def get(self, path: str) -> Any:
        return (await self._send("GET", path, b"", None, retries=0)).json()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, body: bytes, routing_key: str | None, *, retries: int | None = None) -> HttpResponse:
        headers = {**_JSON, ROUTING_KEY_HEADER: routing_key} if routing_key else _JSON
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                response = await self._client.request(method, path, body=body, headers=headers if body else None)
                break
            except _RETRIED as exc:
                if attempt == retries:
                    raise EngineUnavailableError(f"cannot reach {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(0.5 * (attempt + 1))
            except ResponseTimeout as exc:
                raise EngineUnavailableError(f"{self.base_url}{path} did not answer in time: {exc}") from exc
            except HttpError as exc:  # any other failure of the transport
                raise EngineUnavailableError(f"cannot reach {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status >= 400:
            raise EngineRequestError(response.status, _detail(response))
        return response


def _detail(response: HttpResponse) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        return str(data.get("detail") or data.get("error") or data.get("message") or data)[:500]
    return str(data)[:500]
