"""``RequestGuard``: the checks every Miles HTTP server runs before a request reaches its routes.

An ASGI middleware (no framework needed), wrapped around the engine, router and session server:

0. **A host it serves.** The ``Host`` header must name this server: an IP address (any: an address
   is never an attacker's name), ``localhost`` (or ``*.localhost``), or a name in ``allowed_hosts``
   (a server passes its ``--host`` and ``--allowed-host`` flags) or in ``MILES_ALLOWED_HOSTS``
   (comma-separated; ``*`` allows any). Anything else is refused with 400. This is what stops DNS
   rebinding: a web page at ``http://evil.example:<port>`` whose name the attacker re-points at
   127.0.0.1 is, to the browser, same-origin with the server, so its requests carry its own Origin
   (passing check 1) and can read the answers; they also carry ``Host: evil.example``. A request
   without ``Host`` (HTTP/1.0) passes: browsers always send one. The verdict is remembered per
   ``Host`` value (parsing an address cost ~4% of the session server's time per request), in a
   bounded LRU (``HOST_VERDICTS_KEPT`` values of at most ``HOST_VERDICT_MAX_CHARS``): ``Host`` is
   the client's to choose, so a client sending a new one each time evicts, never grows, the cache.
   The verdict is a pure function of the value and the names fixed at construction, so a cached
   one is the one a fresh check would give.
1. **Same origin.** A request with an ``Origin`` header naming another site (a browser page that
   a user has open) is refused with 403: browsers attach ``Origin`` to cross-site requests, other
   clients do not send it.
2. **Token.** Every path outside ``public_paths`` needs ``Authorization: Bearer <token>``
   (:mod:`miles_contracts.wire.auth`); 401 otherwise. ``also_accept`` lets a server take a
   narrower credential on some paths (the session server's per-session keys), presented as a
   bearer token or in one of ``key_headers`` (``x-api-key``, where Anthropic's SDKs put their key);
   only ``also_accept`` ever sees a ``key_headers`` value: the run's token is a bearer token only.
3. **Bounded body.** A body over ``max_body_bytes`` is refused with 413 naming the limit, before
   it is read (``Content-Length``) or as soon as it is exceeded (chunked).
4. **JSON only.** A non-empty body must be ``application/json`` (or ``*/*+json``); 415 otherwise.
   With 1 and 2 this closes every way a web page could make a browser send a request the servers
   would act on (form posts and ``text/plain`` need no CORS pre-flight; JSON does, and nothing here
   answers one).

The body is read whole by the guard (it is bounded) and handed to the app as one message; later
``receive()`` calls reach the server, so an app still learns when its client went away.

A refusal closes the connection, but only once the client has sent its body: the guard reads and
drops the rest first (at most ``DISCARD_MAX_BYTES`` more, for at most ``DISCARD_TIMEOUT_S``). A
socket closed with unread bytes in it is reset, and a client still sending then fails on the reset
(``urllib``: "Broken pipe", "Connection reset by peer") without ever reading the answer. A client
that waits for permission to send (``Expect: 100-continue``) gets the refusal at once, as does one
that announces more than the discard bound.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from miles_contracts.wire.auth import TOKEN_ENV, bearer, is_authorized

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]

ALLOWED_HOSTS_ENV = "MILES_ALLOWED_HOSTS"
"""Host names every Miles server of this environment answers to, comma-separated (``*``: any)."""

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
"""32 MiB: a 128k-token prompt as JSON ids is ~1 MB, a long agent conversation a few MB."""

DISCARD_MAX_BYTES = 64 * 1024 * 1024
"""Most bytes of a refused request's body read (and dropped) so that its client can finish sending
and read the answer; on loopback 64 MiB take well under a second."""
DISCARD_TIMEOUT_S = 10.0
"""Longest wait for a refused request's client to finish sending its body."""

HOST_VERDICTS_KEPT = 256
"""Distinct ``Host`` values whose verdict a guard remembers (least recently used dropped first)."""
HOST_VERDICT_MAX_CHARS = 300
"""Longer ``Host`` values (a DNS name is at most 253 characters, plus a port) are checked every time,
not remembered, so the cache's memory stays bounded whatever clients send."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True, slots=True)
class _Overflow:
    """A body that passed the limit after ``read`` bytes; ``more``: the client is still sending."""

    read: int
    more: bool


def detail_body(status: int, message: str) -> bytes:
    """``{"detail": message}``: the error shape of the engine and the router (FastAPI's)."""
    return json.dumps({"detail": message}).encode()


class RequestGuard:
    """``RequestGuard(app, token=...)``; see the module docstring for what it checks.

    :param public_paths: paths served without a token (health checks).
    :param also_accept: ``(path, presented_token) -> bool``, called when the run's token does not
        match, for credentials narrower than the run's token.
    :param key_headers: headers (lower-case names) whose value is also offered to ``also_accept``
        (never compared with the run's token), e.g. ``x-api-key``.
    :param allowed_hosts: host names (not addresses: those always pass) this server answers to
        besides ``localhost`` and those of ``MILES_ALLOWED_HOSTS``, e.g. the name it binds.
    :param error_body: the bytes of an error answer (status, message); JSON ``{"detail": ...}`` by default.
    """

    def __init__(self, app: Any, *, token: str, public_paths: Iterable[str] = ("/health",),
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 also_accept: Callable[[str, str], bool] | None = None,
                 error_body: ErrorBody = detail_body, allowed_hosts: Iterable[str] = (),
                 key_headers: Iterable[str] = ()) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.app = app
        self.token = token
        self.public_paths = frozenset(public_paths)
        self.max_body_bytes = max_body_bytes
        self.also_accept = also_accept
        self.error_body = error_body
        self.allowed_hosts = host_names(allowed_hosts)
        # ``host_verdicts.cache_info()`` shows its bound and fill
        self.host_verdicts = functools.lru_cache(maxsize=HOST_VERDICTS_KEPT)(
            functools.partial(host_allowed, names=self.allowed_hosts))
        self.key_headers = tuple(h.lower() for h in key_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        carries_body = _carries_body(scope, headers)
        if refusal is None and not carries_body:
            await self.app(scope, receive, send)
            return
        read, more = 0, carries_body
        if refusal is None:
            body = await self._read_body(receive)
            if body is None:  # the client went away
                return
            if isinstance(body, bytes):
                await self.app(scope, _replay(body, receive), send)
                return
            refusal, read, more = (413, self._too_large()), body.read, body.more
        if more and not await _discard_rest(receive, headers, read):
            return  # the client went away
        await self._refuse(send, *refusal)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        host = headers.get("host")
        if host is not None and not self._host_allowed(host):
            return 400, (f"Host {host!r} is not a name this server answers to (a guard against DNS rebinding); "
                         f"address it by IP or as localhost, or start it with --allowed-host NAME (or list the "
                         f"name in {ALLOWED_HOSTS_ENV})")
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, headers.get("host", "")):
            return 403, (f"cross-origin request refused (Origin {origin!r}); Miles servers answer programs, "
                         "not web pages")
        path = scope["path"]
        if path not in self.public_paths and not self._authorized(path, headers):
            return 401, (f"{path} needs the run's token: send 'Authorization: Bearer <token>' with the value of "
                         f"{TOKEN_ENV} (miles train sets it for every service it starts)")
        if _carries_body(scope, headers):  # GET too: some routes (SGLang's) read a GET body
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                return 413, self._too_large()
            has_body = (length is not None and length != "0") or "transfer-encoding" in headers
            if has_body and not _is_json(headers.get("content-type", "")):
                return 415, (f"the body must be JSON (Content-Type: application/json), got "
                             f"{headers.get('content-type') or 'no Content-Type'}")
        return None

    def _host_allowed(self, host: str) -> bool:
        if len(host) > HOST_VERDICT_MAX_CHARS:
            return host_allowed(host, self.allowed_hosts)
        return self.host_verdicts(host)

    def _authorized(self, path: str, headers: dict[str, str]) -> bool:
        header = headers.get("authorization")
        if is_authorized(header, self.token):
            return True
        if self.also_accept is None:
            return False
        offered = [bearer(header), *(headers.get(name) for name in self.key_headers)]
        return any(key and self.also_accept(path, key) for key in offered)

    def _too_large(self) -> str:
        return (f"request body too large: the limit is {self.max_body_bytes} bytes "
                f"({self.max_body_bytes / 2**20:g} MiB); send less per request")

    async def _read_body(self, receive: Receive) -> bytes | _Overflow | None:
        """The whole body, or where it passed the limit, or None when the client went away."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return _Overflow(size, more)
            chunks.append(chunk)
            if not more:
                return b"".join(chunks)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        body = self.error_body(status, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def host_names(names: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``names`` and those of ``MILES_ALLOWED_HOSTS``, lower-case, without a trailing dot."""
    listed = (os.environ if environ is None else environ).get(ALLOWED_HOSTS_ENV, "").split(",")
    return frozenset(n.strip().lower().rstrip(".") for n in [*names, *listed] if n.strip())


def host_allowed(host: str, names: frozenset[str]) -> bool:
    """Whether a ``Host`` header value (``name[:port]``, ``[v6]:port``) names an IP address,
    ``localhost``, a ``*.localhost`` name, or one of ``names`` (``*`` among them: any name)."""
    if host.startswith("["):
        literal, bracket, _ = host[1:].partition("]")
        return bool(bracket) and _is_address(literal)
    name = host.rpartition(":")[0] if ":" in host else host
    name = name.lower().rstrip(".")
    return (_is_address(name) or name == "localhost" or name.endswith(".localhost") or name in names
            or "*" in names)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


async def _discard_rest(receive: Receive, headers: dict[str, str], read: int) -> bool:
    """Read and drop what is left of a refused request's body (see the module docstring), within
    the discard bounds; False when the client went away meanwhile."""
    if read == 0 and headers.get("expect", "").lower() == "100-continue":
        return True  # it sends nothing before it hears from us (reading would tell it to go on)
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) - read > DISCARD_MAX_BYTES:
        return True  # more than is worth reading: answer now, the client may see a reset
    discarded = 0
    try:
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            while discarded <= DISCARD_MAX_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                discarded += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        pass  # a client too slow to wait for: answer anyway
    return True


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", ())}


def _same_origin(origin: str, host: str) -> bool:
    scheme, _, rest = origin.partition("://")
    return scheme in ("http", "https") and bool(host) and rest.rstrip("/").lower() == host.lower()


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _carries_body(scope: Scope, headers: dict[str, str]) -> bool:
    """Whether the request may have a body to bound and check: a body method, or any request that
    announces one."""
    length = headers.get("content-length")
    return scope["method"] in _BODY_METHODS or (length is not None and length != "0") or "transfer-encoding" in headers
