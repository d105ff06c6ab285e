"""Async HTTP client for the engine wire protocol (an engine or the router in front of engines)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from miles_contracts.wire.engine import ROUTING_KEY_HEADER, GenerateRequest, GenerateResponse

from miles.errors import MilesError


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
    between engines itself; this covers the router restarting). HTTP errors are not retried.
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0, retries: int = 2, max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        body = request.model_dump(mode="json", exclude_none=True)
        data = await self.post("/generate", body, routing_key=routing_key)
        return GenerateResponse.model_validate(data)

    async def post(self, path: str, body: dict[str, Any] | None = None, *, routing_key: str | None = None) -> Any:
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else {}
        for attempt in range(self.retries + 1):
            try:
                response = await self._client.post(path, json=body or {}, headers=headers)
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if attempt == self.retries:
                    raise EngineUnavailableError(f"cannot reach {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(0.5 * (attempt + 1))
            except httpx.TimeoutException as exc:
                raise EngineUnavailableError(f"{self.base_url}{path} did not answer in time: {type(exc).__name__}") from exc
        if response.status_code >= 400:
            raise EngineRequestError(response.status_code, _detail(response))
        return response.json()

    async def get(self, path: str) -> Any:
        try:
            response = await self._client.get(path)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"cannot reach {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise EngineRequestError(response.status_code, _detail(response))
        return response.json()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        return str(data.get("detail") or data.get("error") or data.get("message") or data)[:500]
    return str(data)[:500]
