"""The run's secret: how Miles services tell their own callers from anyone else on the network.

One token per run, in the environment variable ``MILES_AUTH_TOKEN``. ``miles train`` makes one when
it is unset (:func:`ensure_run_token`) and every process it starts inherits it; executors that
start processes elsewhere (Ray) pass it explicitly. Clients send it as ``Authorization: Bearer
<token>`` (:func:`auth_headers`), the header SGLang's ``--api-key`` checks, so a real SGLang server
started with ``--api-key "$MILES_AUTH_TOKEN"`` enforces the same token. Servers compare in
constant time (:func:`is_authorized`) and require it on every route but ``/health``.

    from miles_contracts.wire.auth import auth_headers
    httpx.post(f"{engine}/pause_generation", json={}, headers=auth_headers())

A server started by hand takes ``--auth-token`` or the environment variable; with neither it makes
one, puts it in its own environment and prints it (:func:`server_token`), so nothing ever listens
without a token.

The session server hands each session a narrower credential, its key (:func:`new_session_key`):
``miles-sk-`` and 32 random characters. The prefix lets logs (``miles.redaction``) and secret
scanners recognise a key wherever one was printed, without knowing its value.
"""

from __future__ import annotations

import hmac
import os
import secrets
import sys
from collections.abc import MutableMapping

TOKEN_ENV = "MILES_AUTH_TOKEN"
"""The environment variable that carries the run's token."""

AUTHORIZATION = "Authorization"
_SCHEME = "bearer "
_MIN_LENGTH = 16

SESSION_KEY_PREFIX = "miles-sk-"
SESSION_KEY_PATTERN = SESSION_KEY_PREFIX + "[A-Za-z0-9_-]{32}"
"""A session key as a regular expression (the prefix, then ``secrets.token_urlsafe(24)``)."""


class InvalidTokenError(ValueError):
    """A token too short to be a secret, or one that cannot travel in an HTTP header."""


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe characters)."""
    return secrets.token_urlsafe(32)


def new_session_key() -> str:
    """A fresh session key: :data:`SESSION_KEY_PREFIX` and 192 random bits (32 URL-safe characters)."""
    return SESSION_KEY_PREFIX + secrets.token_urlsafe(24)


def check_token(token: str) -> str:
    """``token`` if it can serve as a run's secret, else :class:`InvalidTokenError` saying why."""
    if len(token) < _MIN_LENGTH:
        raise InvalidTokenError(f"an auth token must have at least {_MIN_LENGTH} characters (got {len(token)}); "
                                f"make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if not token.isascii() or not token.isprintable() or " " in token:
        raise InvalidTokenError("an auth token must be printable ASCII without spaces (it travels in an HTTP header)")
    return token


def run_token(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The token in ``MILES_AUTH_TOKEN`` (None when unset or empty)."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()
    return value or None


def ensure_run_token(environ: MutableMapping[str, str] | None = None) -> str:
    """The run's token: the one in the environment, else a new one written there (children inherit it)."""
    environ = os.environ if environ is None else environ
    token = run_token(environ)
    if token is None:
        token = environ[TOKEN_ENV] = new_token()
    return check_token(token)


def server_token(explicit: str | None = None, *, name: str = "server") -> str:
    """The token a server started by hand requires: ``explicit`` (its ``--auth-token``), else the
    environment's; with neither, a new one, set in this process's environment and printed to
    stderr so that the operator can hand it to clients."""
    if explicit:
        token = os.environ[TOKEN_ENV] = check_token(explicit.strip())
        return token
    existing = run_token()
    if existing is not None:
        return check_token(existing)
    token = ensure_run_token()
    print(f"miles {name}: no --auth-token and no {TOKEN_ENV} given; every route but /health needs this token:\n"
          f"  export {TOKEN_ENV}={token}", file=sys.stderr, flush=True)
    return token


def auth_headers(token: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` for ``token`` (default: the run's); ``{}`` when there is none."""
    token = token if token is not None else run_token()
    return {AUTHORIZATION: f"Bearer {token}"} if token else {}


def bearer(header_value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None when absent or another scheme)."""
    if not header_value or header_value[: len(_SCHEME)].lower() != _SCHEME:
        return None
    return header_value[len(_SCHEME):].strip() or None


def is_authorized(header_value: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token``; compares in constant time."""
    presented = bearer(header_value)
    return presented is not None and hmac.compare_digest(presented.encode(), token.encode())
