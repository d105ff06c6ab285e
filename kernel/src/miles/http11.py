"""A lean asyncio HTTP/1.1 client with a keep-alive connection pool, for calls between Miles' services.

Why not httpx: the session server makes one engine call per chat request, and a py-spy profile
put a third of its CPU in httpx (URL and header models, h11's state machine, anyio streams, and a
connection pool that rescans every connection on each request, so its cost grows with the number
of sessions). This client does only what a call to an engine or the router needs, with a single
``transport.write`` per request and the response parsed straight out of ``data_received``:

* ``http://`` and ``https://``; no proxies, redirects, cookies, compression or HTTP/2;
* the request body is bytes, the response is read whole (``Content-Length``, chunked, or until
  the server closes);
* keep-alive connections are reused most-recent first; one idle longer than ``keepalive_expiry``
  is dropped (below uvicorn's 5 s, so the client, not the server, closes it); a reused connection
  that the server had closed meanwhile is retried once on a new connection (nothing of the
  response had arrived, so the server never answered on it);
* at most ``max_connections`` are open; further requests wait for one, within their timeout.

Errors are :class:`HttpError` subclasses that say what happened: :class:`ConnectFailed`,
:class:`ConnectionLost`, :class:`ResponseTimeout`, :class:`ProtocolError`.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from miles_contracts.wire.auth import auth_headers

from miles.http11_parser import (
    MAX_HEAD_BYTES,
    ConnectFailed,
    ConnectionLost,
    HttpError,
    HttpResponse,
    ProtocolError,
    ResponseParser,
    ResponseTimeout,
)

__all__ = ["MAX_HEAD_BYTES", "ConnectFailed", "ConnectionLost", "HttpClient", "HttpError", "HttpResponse",
           "ProtocolError", "ResponseParser", "ResponseTimeout"]


_INLINE_BODY_BYTES = 256 * 1024
_UNSAFE_TARGET = re.compile(r"[^\x21-\x7e]")  # anything but visible ASCII
"""Bodies up to this size are copied into the head's buffer: one write, one packet when small."""


# ------------------------------------------------------------------------------------- connection


class _Connection(asyncio.Protocol):
    """One keep-alive connection: writes a request, resolves a future with the parsed response."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser: ResponseParser | None = None
        self._waiter: asyncio.Future[HttpResponse] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._write_paused = False
        self.closed = False
        self.reusable = True
        self.used = False
        self.idle_since = 0.0

    # asyncio.Protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        waiter, parser = self._waiter, self._parser
        if waiter is None or parser is None or waiter.done():
            self.reusable = False  # bytes nobody asked for: the stream can't be trusted
            self.close()
            return
        try:
            response = parser.feed(data)
        except HttpError as exc:
            self.reusable = False
            waiter.set_exception(exc)
            self.close()
            return
        if response is not None:
            self.reusable = parser.keep_alive
            waiter.set_result(response)

    def eof_received(self) -> bool:
        self.reusable = False
        return False  # close our side too; connection_lost finishes the response or fails it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        waiter, parser = self._waiter, self._parser
        if waiter is not None and parser is not None and not waiter.done():
            try:
                waiter.set_result(parser.feed_eof())
            except ConnectionLost as lost:
                if exc is not None:
                    lost.args = (f"{lost.args[0]} ({type(exc).__name__}: {exc})",)
                waiter.set_exception(lost)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    # use

    def usable(self, loop: asyncio.AbstractEventLoop, expiry: float) -> bool:
        """Whether an idle connection may carry the next request (on ``loop``)."""
        if not self.reusable or self.closed or self._loop is not loop or self._transport is None:
            return False
        return not self._transport.is_closing() and loop.time() - self.idle_since < expiry

    def forget(self) -> None:
        """Close, unless the connection belongs to another event loop (which may be closed already)."""
        if self._loop is asyncio.get_running_loop():
            self.close()

    async def exchange(self, head: bytes, body: bytes, *, no_body: bool, timeout: float, limit: float) -> HttpResponse:
        """Send one request and wait for its whole response, at most ``timeout`` seconds (the rest of
        the request's ``limit``, which the error names)."""
        if self.closed or self._transport is None:
            raise ConnectionLost("the server closed the connection without answering", response_started=False)
        self.used = True
        self._parser = ResponseParser(no_body=no_body)
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, self._time_out, waiter, limit)
        try:
            self._write(head, body)
            while self._write_paused and not self.closed:
                self._drain = self._loop.create_future()
                await self._drain
            response: HttpResponse = await waiter
            return response
        except BaseException:
            self.reusable = False  # cancelled or failed mid-exchange: the stream's state is unknown
            raise
        finally:
            timer.cancel()
            self._waiter = None
            self._parser = None

    def _write(self, head: bytes, body: bytes) -> None:
        assert self._transport is not None
        try:
            if body and len(body) <= _INLINE_BODY_BYTES:
                self._transport.write(head + body)
            else:
                self._transport.write(head)
                if body:
                    self._transport.write(body)
        except (RuntimeError, OSError) as exc:  # the transport closed under us (the server hung up)
            raise ConnectionLost(f"the connection closed before the request was sent ({exc})", response_started=False) from exc

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _time_out(self, waiter: asyncio.Future[HttpResponse], timeout: float) -> None:
        if not waiter.done():
            waiter.set_exception(ResponseTimeout(f"no complete response within {timeout:g}s"))
        self.close()

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None


# ------------------------------------------------------------------------------------------- pool


class HttpClient:
    """``await client.request("POST", "/generate", body=..., headers=...)`` against one base URL.

    :param base_url: ``http://host:port`` (or ``https://``), optionally with a path prefix.
    :param timeout: default seconds for a whole request: waiting for a connection, sending, the answer.
    :param connect_timeout: seconds to open a connection.
    :param max_connections: most connections open at once.
    :param keepalive_expiry: an idle connection older than this is closed, not reused.
    :param auth_token: sent as ``Authorization: Bearer <token>`` with every request; default the
        run's (``MILES_AUTH_TOKEN``), none when that is unset. Miles servers refuse requests without it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 512,
        keepalive_expiry: float = 4.0,
        auth_token: str | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {base_url!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rpartition("@")[2]
        self._host_line = f"Host: {host_header}\r\n"
        self._auth_line = "".join(f"{k}: {v}\r\n" for k, v in auth_headers(auth_token).items())
        self._idle: list[_Connection] = []
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[_Connection | None]] = collections.deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> HttpResponse:
        """One request; raises :class:`HttpError` subclasses (never for an HTTP error status)."""
        if self._closed:
            raise RuntimeError("this HttpClient is closed")
        loop = asyncio.get_running_loop()
        limit = self.timeout if timeout is None else timeout
        deadline = loop.time() + limit
        head = self._head(method, path, body, headers)
        no_body = method.upper() == "HEAD"
        for fresh in (False, True):
            connection = await self._acquire(loop, deadline, fresh=fresh)
            reused = connection.used
            try:
                remaining = max(0.0, deadline - loop.time())
                response = await connection.exchange(head, body, no_body=no_body, timeout=remaining, limit=limit)
            except ConnectionLost as exc:
                self._discard(connection)
                if reused and not exc.response_started and not fresh:
                    continue  # the server had closed this idle connection: try once on a new one
                raise
            except BaseException:
                self._discard(connection)
                raise
            self._release(connection, loop)
            return response
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close every idle connection; connections in use are closed when their request ends."""
        self._closed = True
        for connection in self._idle:
            connection.forget()
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(RuntimeError("this HttpClient was closed while the request waited for a connection"))
        self._waiters.clear()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # request bytes

    def _head(self, method: str, path: str, body: bytes, headers: Mapping[str, str] | None) -> bytes:
        if _UNSAFE_TARGET.search(path):  # a space or CR/LF would end the request line; text is not bytes
            raise ValueError(f"invalid request target {path!r}: percent-encode it (urllib.parse.quote) to "
                             "visible ASCII")
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\n", self._host_line, self._auth_line]
        if headers:
            for name, value in headers.items():
                if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
                    raise ValueError(f"invalid header {name!r}: {value!r}")
                lines.append(f"{name}: {value}\r\n")
        if body or method.upper() in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    # pool

    async def _acquire(self, loop: asyncio.AbstractEventLoop, deadline: float, *, fresh: bool) -> _Connection:
        if not fresh:
            connection = self._take_idle(loop)
            if connection is not None:
                return connection
        elif self._idle and self._open >= self.max_connections:
            self._idle.pop(0).forget()  # make room (the oldest idle one) for the new connection this retry needs
            self._open -= 1
        if self._open >= self.max_connections:
            connection = await self._wait_for_slot(loop, deadline)
            if connection is not None:
                return connection
        else:
            self._open += 1
        try:
            return await self._connect(loop, deadline)
        except BaseException:
            self._free_slot()
            raise

    def _take_idle(self, loop: asyncio.AbstractEventLoop) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(loop, self.keepalive_expiry):
                return connection
            connection.forget()
            self._open -= 1
        return None

    async def _wait_for_slot(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection | None:
        """Wait until a connection is released (returned) or closed (None: a slot to open one in)."""
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(max(0.0, deadline - loop.time()), _expire, waiter, self.max_connections)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._hand_back(waiter.result(), loop)  # woken, then cancelled: pass it on
            raise
        finally:
            timer.cancel()
            if not waiter.done():
                waiter.cancel()

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Connection:
        timeout = min(self.connect_timeout, max(0.0, deadline - loop.time()))
        where = f"{self._host}:{self._port}"
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), self._host, self._port, ssl=self._ssl
                )
        except TimeoutError:
            raise ConnectFailed(f"connecting to {where} timed out after {timeout:g}s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {where}: {exc.strerror or exc}") from exc
        return connection

    def _release(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        if self._closed or not connection.reusable or connection.closed:
            self._discard(connection)
            return
        connection.idle_since = loop.time()
        self._hand_back(connection, loop)

    def _hand_back(self, connection: _Connection | None, loop: asyncio.AbstractEventLoop) -> None:
        """Give a connection (or, for None, a free slot) to the first waiter, else keep it idle."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        if connection is None:
            self._open -= 1
        else:
            self._idle.append(connection)

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        self._free_slot()

    def _free_slot(self) -> None:
        if self._waiters and not self._closed:
            self._hand_back(None, asyncio.get_running_loop())
        else:
            self._open -= 1


def _expire(waiter: asyncio.Future[Any], limit: int) -> None:
    if not waiter.done():
        waiter.set_exception(ResponseTimeout(f"no free connection within the timeout (all {limit} in use)"))
