"""HTTP calls to the engines of a weight sync, sent to all of them at once.

Every call names its *step* ("pause generation", "bucket 3 (...)"), so a failure says which engine
failed at which step and what it answered. Engines are called concurrently from a small thread
pool: a sync is as slow as the slowest engine, not the sum of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
from miles_contracts.wire.auth import auth_headers

from miles_weights.errors import WeightSyncError

_MAX_DETAIL = 600


def normalize_targets(targets: Sequence[str] | str) -> list[str]:
    """Engine base URLs without trailing slashes; rejects empty, malformed or repeated ones."""
    if isinstance(targets, str):
        targets = [targets]
    urls: list[str] = []
    for raw in targets:
        url = str(raw).strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine target {raw!r} is not a base URL; expected e.g. 'http://127.0.0.1:30000'")
        if url in urls:
            raise ValueError(f"engine target {url} is listed twice; each engine must appear once")
        urls.append(url)
    if not urls:
        raise ValueError("no engine targets given: pass the base URL of every engine to update")
    return urls


def _detail(response: httpx.Response) -> str:
    """What the engine said: its JSON ``message`` / ``detail`` / ``error``, else the raw body."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text[:_MAX_DETAIL] or "(empty body)"
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            if body.get(key):
                value = body[key]
                return (value if isinstance(value, str) else json.dumps(value))[:_MAX_DETAIL]
    return json.dumps(body)[:_MAX_DETAIL]


class EngineCalls:
    """Concurrent JSON calls to engine base URLs, turning every failure into a clear error."""

    def __init__(self, *, timeout: float, connect_timeout: float = 10.0, auth_token: str | None = None) -> None:
        self.timeout = timeout
        # every call carries the run's token (engines refuse control routes without it), never
        # through a proxy named by HTTP_PROXY (it would see the token; see miles.loopback)
        self._client = httpx.Client(timeout=httpx.Timeout(timeout, connect=connect_timeout),
                                    headers=auth_headers(auth_token), trust_env=False)
        self._pool_size = 16
        self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="miles-weights-http")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ------------------------------------------------------------------ single calls

    def call(self, url: str, method: str, path: str, body: Any = None, *, step: str) -> dict[str, Any]:
        """One request; returns the JSON answer (``{}`` for an empty one) or raises
        :class:`WeightSyncError` naming ``url`` and ``step``."""
        try:
            response = self._client.request(method, url + path, json=body)
        except httpx.ConnectError as exc:
            raise WeightSyncError(
                f"{step}: cannot reach engine {url} ({exc}); check that it is running and that the URL is right"
            ) from exc
        except httpx.TimeoutException as exc:
            raise WeightSyncError(
                f"{step}: engine {url} did not answer {method} {path} within {self.timeout:.0f} s "
                f"(weight_transport.http_timeout)"
            ) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{step}: {method} {url}{path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise WeightSyncError(
                f"{step}: engine {url} rejected {method} {path} with HTTP {response.status_code}: {_detail(response)}"
            )
        if not response.content:
            return {}
        try:
            answer = response.json()
        except ValueError:
            return {"text": response.text}
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{step}: engine {url} refused {method} {path}: {_detail(response)}")
        return answer if isinstance(answer, dict) else {"value": answer}

    def get_optional(self, url: str, path: str, *, step: str) -> dict[str, Any] | None:
        """``GET`` that answers ``None`` when the engine does not serve ``path`` (HTTP 404)."""
        try:
            response = self._client.get(url + path)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{step}: cannot reach engine {url} ({exc}); check that it is running") from exc
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise WeightSyncError(f"{step}: engine {url} rejected GET {path} with HTTP {response.status_code}: {_detail(response)}")
        return response.json()

    # ------------------------------------------------------------------ fan-out

    def submit(self, urls: Sequence[str], method: str, path: str, bodies: Mapping[str, Any] | Any = None, *,
               step: str, per_engine: bool = False) -> dict[str, Future[dict[str, Any]]]:
        """Start the call on every engine; ``bodies`` maps URL -> body when ``per_engine``."""
        if len(urls) > self._pool_size:
            # every engine's call must be in flight at once: a broadcast blocks until all engines joined
            self._pool.shutdown(wait=False)
            self._pool_size = len(urls)
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="miles-weights-http")
        return {
            url: self._pool.submit(self.call, url, method, path, bodies[url] if per_engine else bodies, step=step)
            for url in urls
        }

    @staticmethod
    def collect(futures: Mapping[str, Future[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        """Wait for every call; raise one error listing every engine that failed."""
        answers: dict[str, dict[str, Any]] = {}
        errors: list[str] = []
        for url, future in futures.items():
            try:
                answers[url] = future.result()
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors:
            if len(errors) == 1:
                raise WeightSyncError(errors[0])
            raise WeightSyncError(f"{len(errors)} engines failed:\n" + "\n".join(f"  - {e}" for e in errors))
        return answers

    def post_all(self, urls: Sequence[str], path: str, body: Any = None, *, step: str) -> dict[str, dict[str, Any]]:
        return self.collect(self.submit(urls, "POST", path, body, step=step))

    def flush_all(self, urls: Sequence[str], *, step: str) -> list[str]:
        """``POST /flush_cache`` on every engine; returns the engines that declined with 400 because
        requests were queued (SGLang's rule, which the embedded engine follows); other failures raise."""
        futures = {url: self._pool.submit(self._client.post, url + "/flush_cache") for url in urls}
        declined = []
        for url, future in futures.items():
            try:
                response = future.result()
            except httpx.HTTPError as exc:
                raise WeightSyncError(f"{step}: cannot reach engine {url} ({exc}); check that it is running") from exc
            if response.status_code == 400:
                declined.append(url)
            elif response.status_code >= 400:
                raise WeightSyncError(f"{step}: engine {url} rejected POST /flush_cache with HTTP "
                                      f"{response.status_code}: {_detail(response)}")
        return declined

    def get_all(self, urls: Sequence[str], path: str, *, step: str) -> dict[str, dict[str, Any]]:
        return self.collect(self.submit(urls, "GET", path, step=step))
