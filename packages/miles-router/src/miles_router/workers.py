"""One engine behind the router (:class:`Worker`) and how its URL is checked."""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class InvalidWorkerUrl(ValueError):
    """A worker URL that the router cannot talk to; the message says what to give instead."""


class WorkerState(enum.StrEnum):
    """Where a worker stands. Only ``HEALTHY`` workers are sent requests.

    ``PENDING``: added, has not answered a health probe yet (an engine still starting).
    ``QUARANTINED``: failed ``failure_threshold`` checks or requests in a row; still probed, and
    re-admitted when it answers again.
    ``STALE_WEIGHTS``: answers, but its ``weight_version`` is behind the fleet's; still probed and
    still sent fan-outs (so a weight update brings it back), never sent generation requests.
    """

    PENDING = "pending"
    HEALTHY = "healthy"
    QUARANTINED = "quarantined"
    STALE_WEIGHTS = "stale_weights"


@dataclass(slots=True, eq=False)
class Worker:
    """Router-side record of one engine.

    :ivar in_flight: requests dispatched to it and not yet finished (the selection policy's load).
    :ivar dispatched: requests ever dispatched to it (tie-break: spread an idle fleet evenly).
    :ivar consecutive_failures: failed probes or connections since its last success.
    :ivar reason: why it is not healthy, for people reading ``/list_workers``.
    :ivar paused: its last probe said generation is paused (a weight sync, or an operator): it
        stays healthy (no failure counted), but new requests go to unpaused workers while any serve.
    """

    url: str
    state: WorkerState = WorkerState.PENDING
    in_flight: int = 0
    dispatched: int = 0
    failed_requests: int = 0
    consecutive_failures: int = 0
    weight_version: str | None = None
    last_error: str | None = None
    reason: str | None = "not probed yet"
    paused: bool = False
    state_since: float = field(default_factory=time.time)

    @property
    def serving(self) -> bool:
        return self.state is WorkerState.HEALTHY

    def move_to(self, state: WorkerState, reason: str | None) -> None:
        if state is not self.state:
            self.state_since = time.time()
        self.state = state
        self.reason = reason

    def describe(self) -> dict[str, Any]:
        """The worker as ``/list_workers`` shows it."""
        return {
            "url": self.url,
            "state": self.state.value,
            "healthy": self.serving,
            "paused": self.paused,
            "in_flight": self.in_flight,
            "dispatched": self.dispatched,
            "failed_requests": self.failed_requests,
            "consecutive_failures": self.consecutive_failures,
            "weight_version": self.weight_version,
            "reason": self.reason,
            "last_error": self.last_error,
            "state_since": self.state_since,
        }


_EXAMPLE = "http://127.0.0.1:30000"
_HOST = re.compile(r"[a-z0-9._-]+|[0-9a-f:.]+")  # a DNS name or IPv4 address; an IPv6 address


def normalize_worker_url(raw: object) -> str:
    """``scheme://host:port`` with a lower-case host and no trailing slash.

    :raises InvalidWorkerUrl: for anything else (no scheme, a path, a bad port ...), saying why.
    """
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidWorkerUrl(f"worker URL must be a non-empty string like {_EXAMPLE}, got {raw!r}")
    text = raw.strip()
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # "http://[::1" (an unclosed IPv6 bracket)
        raise InvalidWorkerUrl(f"worker URL {text!r} is not a URL ({exc}); e.g. {_EXAMPLE}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidWorkerUrl(f"worker URL {text!r} must start with http:// or https:// (e.g. {_EXAMPLE})")
    try:
        port = parts.port
    except ValueError:
        raise InvalidWorkerUrl(f"worker URL {text!r} has an invalid port; give a number in 1-65535") from None
    if not parts.hostname:
        raise InvalidWorkerUrl(f"worker URL {text!r} has no host (e.g. {_EXAMPLE})")
    if parts.username or parts.password:
        raise InvalidWorkerUrl(f"worker URL {text!r} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidWorkerUrl(
            f"worker URL {text!r} must be the engine's base URL without path or query (e.g. {_EXAMPLE})"
        )
    if port == 0:
        raise InvalidWorkerUrl(f"worker URL {text!r} has port 0; give the port the engine listens on")
    host = parts.hostname.lower()
    if not _HOST.fullmatch(host):  # a NUL or a space would fail only later, in every probe and request
        raise InvalidWorkerUrl(f"worker URL {text!r} has host {host!r}; give a DNS name (ASCII; punycode for others) "
                               "or an IP address")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
