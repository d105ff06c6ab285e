"""Sends one request to one engine, failing over to another when the engine did not answer.

Failover happens only when the engine cannot have produced an answer the caller would miss: the
connection was refused, reset or closed before the full response arrived, the engine said 503, or
the engine was quarantined while the request waited on it (it stopped answering its health probes:
frozen, hung, its host gone; the connection is closed, so an engine that wakes up again aborts the
request). The request is then tried on the next worker (never one already tried) up to
``max_attempts`` engines; after that, or when no worker serves, the router answers with an abort
that says why (:mod:`miles_router.aborts`). ``request_timeout`` bounds the whole request, every
attempt included: a request that outlives it is not retried (the engine may still be working on
it) and ends as an abort too. Engine answers of any other status are passed through unchanged --
a 400 would be a 400 on every engine.

Two HTTP clients: requests that ask to stream (``"stream": true`` in the body) go through httpx,
which relays the engine's events as they come; every other request goes through Miles' lean
HTTP/1.1 client (:mod:`miles.http11`), one keep-alive pool per engine (``router.forward_client:
httpx`` sends those through httpx too). httpx's pool rescans all
of its connections on every request, which at a few hundred requests in flight cost the router
more CPU than everything else it does (measured with py-spy on ``miles train``: ~55% of the
router's samples); the lean client hands out idle connections from a stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn
from urllib.parse import quote, urlencode

import httpx
from miles.http11 import ConnectFailed, ConnectionLost, HttpClient, ProtocolError, ResponseTimeout
from miles_contracts import RouterRequest, RouterResponse
from miles_contracts.wire.engine import ROUTING_KEY_HEADER

from miles_router.aborts import GENERATE_PATH, abort_event, router_abort
from miles_router.adapters import AdapterPerVersion
from miles_router.fleet import Fleet
from miles_router.health import describe_error
from miles_router.middleware import STATE_ATTEMPTS, STATE_QUERY, STATE_TRIED
from miles_router.selection import LeastInFlight
from miles_router.versions import as_version
from miles_router.workers import Worker

log = logging.getLogger(__name__)

WORKER_HEADER = "X-Miles-Worker"
ATTEMPTS_HEADER = "X-Miles-Attempts"

# The engine is gone or never got the request: safe to send it elsewhere.
_FAILOVER_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                    httpx.WriteTimeout, httpx.RemoteProtocolError, httpx.CloseError)
_LEAN_FAILOVER_ERRORS = (ConnectFailed, ConnectionLost, ProtocolError)
_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
               "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding",
               "authorization", "origin"}
"""Not forwarded: hop-by-hop headers, and the caller's credentials (the router sends its own token)."""


class _Retry(Exception):
    """This attempt failed before the engine answered; try another worker."""


class _Abandoned(Exception):
    """Raised in a request waiting on a worker that was just quarantined."""


class Forwarder:
    def __init__(self, fleet: Fleet, policy: LeastInFlight, client: httpx.AsyncClient, *,
                 max_attempts: int, request_timeout: float, connect_timeout: float, lean: bool = True,
                 auth_token: str | None = None, adapters: AdapterPerVersion | None = None) -> None:
        self.fleet = fleet
        self.adapters = adapters  # LoRA on SGLang: /generate names the chosen engine's adapter
        self.auth_token = auth_token
        self.policy = policy
        self.client = client
        self.max_attempts = max_attempts
        self.lean = lean
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._lean: dict[str, HttpClient] = {}  # engine URL -> its keep-alive pool
        self._waiting: dict[Worker, set[asyncio.Task[Any]]] = {}  # worker -> requests waiting on its answer
        self._abandoned: set[asyncio.Task[Any]] = set()  # cancelled by abandon(), not by anyone else
        fleet.on_quarantine = self.abandon

    async def aclose(self) -> None:
        for client in self._lean.values():
            await client.aclose()
        self._lean.clear()

    def _lean_client(self, url: str) -> HttpClient:
        client = self._lean.get(url)
        if client is None:
            # Keep-alive shorter than uvicorn's 5 s so an engine never closes a connection we reuse.
            client = HttpClient(url, timeout=self.request_timeout, connect_timeout=self.connect_timeout,
                                max_connections=4096, keepalive_expiry=2.0, auth_token=self.auth_token)
            self._lean[url] = client
        return client

    def abandon(self, worker: Worker) -> None:
        """``worker`` was quarantined: every request waiting on its answer tries another worker
        (the fleet calls this; the attempts raise in their own tasks)."""
        current = asyncio.current_task()
        for task in self._waiting.get(worker, ()):
            if task is not current and not task.done():  # the current task is failing over already
                self._abandoned.add(task)
                task.cancel(f"engine {worker.url} was quarantined")

    @contextlib.contextmanager
    def _waiting_on(self, worker: Worker) -> Iterator[None]:
        """The block waits for ``worker``'s answer; :meth:`abandon` ends the wait with :class:`_Abandoned`."""
        task = asyncio.current_task()
        if task is None:  # not in a task: nothing to cancel
            yield
            return
        waiting = self._waiting.setdefault(worker, set())
        waiting.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._abandoned:
                raise
            self._abandoned.discard(task)
            if task.uncancel() > 0:  # cancelled by someone else as well (the client went away)
                raise
            raise _Abandoned() from None
        finally:
            waiting.discard(task)
            if not waiting:
                self._waiting.pop(worker, None)

    async def forward(self, request: RouterRequest) -> RouterResponse:
        tried: list[str] = []
        failures: list[str] = []
        request.state[STATE_TRIED] = tried
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout
        while len(tried) < self.max_attempts:
            worker = self.policy.choose(self.fleet.routable(), request.routing_key, exclude=tried,
                                        body=request.body if request.path == "/generate" else None)
            if worker is None:
                break
            left = deadline - loop.time()
            if left <= 0:
                request.state[STATE_ATTEMPTS] = len(tried)
                return router_abort(request, "timeout", f"no engine answered within the request timeout of "
                                    f"{self.request_timeout:g}s: " + "; ".join(failures))
            tried.append(worker.url)
            request.state[STATE_ATTEMPTS] = len(tried)
            try:
                response = await self._attempt(worker, request, left)
            except _Retry as exc:
                failures.append(f"{worker.url}: {exc}")
                log.warning("%s %s failed on %s (%s); failing over", request.method, request.path, worker.url, exc)
                continue
            response.headers[ATTEMPTS_HEADER] = str(len(tried))
            return response
        request.state[STATE_ATTEMPTS] = len(tried)
        if failures:
            return router_abort(request, "attempts_exhausted",
                                f"no engine answered after {len(tried)} attempt(s): " + "; ".join(failures))
        return router_abort(request, "no_worker", self._no_worker_reason())

    def _no_worker_reason(self) -> str:
        if not len(self.fleet):
            return "no engine is registered with the router (add one with POST /add_worker?url=...)"
        states = ", ".join(f"{w.url} {w.state.value}" + (f" ({w.reason})" if w.reason else "") for w in self.fleet)
        return f"no healthy engine to serve the request: {states}"

    async def _attempt(self, worker: Worker, request: RouterRequest, timeout: float) -> RouterResponse:
        """One try of ``request`` on ``worker`` within ``timeout`` seconds (what is left of the
        request's ``request_timeout``); raises :class:`_Retry` when another worker should try."""
        if not self.lean or (isinstance(request.body, dict) and request.body.get("stream")):
            return await self._attempt_httpx(worker, request, timeout)
        body, fields = self._body_for(worker, request)
        worker.in_flight += 1
        worker.dispatched += 1
        try:
            try:
                with self._waiting_on(worker):
                    answer = await self._lean_client(worker.url).request(
                        request.method, _path_and_query(request), body=_payload(body) or b"",
                        headers=_forwarded_headers(request), timeout=timeout,
                    )
            except _LEAN_FAILOVER_ERRORS as exc:
                self._connection_failed(worker, exc)
            except ResponseTimeout as exc:
                return self._timed_out(worker, request, exc)
            except _Abandoned:
                raise _Retry(_quarantined(worker)) from None
        finally:
            worker.in_flight -= 1
        if answer.status == 503:
            raise _Retry("engine answered HTTP 503 (unavailable)")
        content_type = answer.headers.get("content-type", "application/json")
        return self._answered(worker, request, answer.status, content_type, answer.body, fields)

    def _body_for(self, worker: Worker, request: RouterRequest) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The body sent to ``worker``, and the adapter fields added to it (see :mod:`miles_router.adapters`)."""
        if self.adapters is None or request.path != GENERATE_PATH or not isinstance(request.body, dict):
            return request.body, {}
        fields = self.adapters.fields(worker.weight_version)
        return ({**request.body, **fields} if fields else request.body), fields

    def _answered(self, worker: Worker, request: RouterRequest, status: int, content_type: str,
                  content: bytes, fields: dict[str, str]) -> RouterResponse:
        self.fleet.record_success(worker)
        body = _decode(content, content_type)
        if request.path == GENERATE_PATH and status == 200:
            worker.paused = False  # it generated: whatever held it has been continued
            self._observe_version(worker, body)
            if self.adapters is not None:
                self.adapters.label(body, fields)
        return RouterResponse(status_code=status, body=body, worker_url=worker.url,
                              headers={"content-type": content_type, WORKER_HEADER: worker.url})

    async def _attempt_httpx(self, worker: Worker, request: RouterRequest, timeout: float) -> RouterResponse:
        body, fields = self._body_for(worker, request)
        worker.in_flight += 1
        worker.dispatched += 1
        handed_to_stream = False
        try:
            outgoing = self.client.build_request(
                request.method, worker.url + wire_path(request.path), params=request.state.get(STATE_QUERY) or None,
                headers=_forwarded_headers(request), content=_payload(body),
                timeout=httpx.Timeout(timeout, connect=min(self.connect_timeout, timeout), pool=None),
            )
            try:
                with self._waiting_on(worker):
                    upstream = await self.client.send(outgoing, stream=True)
            except _FAILOVER_ERRORS as exc:
                self._connection_failed(worker, exc)
            except httpx.TimeoutException as exc:
                return self._timed_out(worker, request, exc)
            except _Abandoned:
                raise _Retry(_quarantined(worker)) from None
            if upstream.status_code == 503:
                await upstream.aclose()
                raise _Retry("engine answered HTTP 503 (unavailable)")
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                handed_to_stream = True
                return self._stream(worker, upstream)
            try:
                with self._waiting_on(worker):
                    content = await upstream.aread()
            except _FAILOVER_ERRORS as exc:
                self._connection_failed(worker, exc)
            except httpx.TimeoutException as exc:
                return self._timed_out(worker, request, exc)
            except _Abandoned:
                raise _Retry(_quarantined(worker)) from None
            finally:
                await upstream.aclose()
        finally:
            if not handed_to_stream:
                worker.in_flight -= 1
        content_type = upstream.headers.get("content-type", "application/json")
        return self._answered(worker, request, upstream.status_code, content_type, content, fields)

    def _connection_failed(self, worker: Worker, exc: Exception) -> NoReturn:
        worker.failed_requests += 1
        if worker in self.fleet:
            self.fleet.record_failure(worker, describe_error(exc))
        raise _Retry(describe_error(exc))

    def _timed_out(self, worker: Worker, request: RouterRequest, exc: Exception) -> RouterResponse:
        worker.failed_requests += 1
        reason = (f"engine {worker.url} did not answer within {self.request_timeout:g}s ({describe_error(exc)}); "
                  "not retried, it may still be running")
        response = router_abort(request, "timeout", reason)
        response.worker_url = worker.url
        return response

    def _stream(self, worker: Worker, upstream: httpx.Response) -> RouterResponse:
        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except _FAILOVER_ERRORS as exc:  # the engine died mid-stream: end it with an abort event
                worker.failed_requests += 1
                if worker in self.fleet:
                    self.fleet.record_failure(worker, describe_error(exc))
                yield abort_event(f"engine {worker.url} failed mid-stream: {describe_error(exc)}")
            finally:
                worker.in_flight -= 1
                await upstream.aclose()

        return RouterResponse(
            status_code=upstream.status_code, body=relay(), worker_url=worker.url,
            headers={"content-type": upstream.headers["content-type"], WORKER_HEADER: worker.url},
        )

    def _observe_version(self, worker: Worker, body: Any) -> None:
        first = body[0] if isinstance(body, list) and body else body
        meta = first.get("meta_info") if isinstance(first, dict) else None
        if isinstance(meta, dict) and "weight_version" in meta and worker in self.fleet:
            self.fleet.observe_version(worker, as_version(meta["weight_version"]))


def _quarantined(worker: Worker) -> str:
    return f"the engine was quarantined while the request waited on it ({worker.reason})"


def _forwarded_headers(request: RouterRequest) -> dict[str, str]:
    # The routing key and content type are re-set from the request (a middleware may change them).
    replaced = _HOP_BY_HOP | {ROUTING_KEY_HEADER.lower(), "content-type"}
    headers = {k: v for k, v in request.headers.items() if k.lower() not in replaced}
    if request.routing_key:
        headers[ROUTING_KEY_HEADER] = request.routing_key
    if request.body is not None:
        headers["content-type"] = "application/json"
    return headers


def _path_and_query(request: RouterRequest) -> str:
    query = request.state.get(STATE_QUERY)  # the raw query string (or a mapping set by a middleware)
    if not query:
        return wire_path(request.path)
    return f"{wire_path(request.path)}?{query if isinstance(query, str) else urlencode(query, doseq=True)}"


def wire_path(path: str) -> str:
    """``path`` as it goes on the wire: the router matches routes on the decoded path, and what it
    decoded (``%E4%B8%AD``, ``%0D%0A``, ``%3F``) must be encoded again, or it could not be written
    (HTTP request lines are bytes, not text), would end the request line early, or start a query."""
    return quote(path, safe="/:@!$&'()*+,;=")


def _payload(body: dict[str, Any] | None) -> bytes | None:
    return None if body is None else json.dumps(body).encode()


def _decode(content: bytes, content_type: str) -> Any:
    if "json" in content_type:
        try:
            return json.loads(content)
        except ValueError:
            pass
    return content
