"""Constants and helpers the security tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from miles_contracts.testing.processes import wait_ready
from miles_contracts.wire.auth import auth_headers

MAX_BODY = 1 << 20
"""The body limit the suite's servers run with (1 MiB): small enough to reach cheaply."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Served:
    url: str
    client: httpx.Client  # carries the run's token, as every Miles client does
    target: Any = None  # the in-process Engine, Router or SessionService


class ThreadServer:
    """uvicorn serving ``app`` on a thread of this process."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                   timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_ready(lambda: bool(self.server.started), f"the test server on port {self.port} to start",
                   alive=self.thread.is_alive, interval_s=0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def serve_engine(model: Path, **options: Any) -> Iterator[Served]:
    """A real engine (tiny model) behind uvicorn on loopback, with the suite's small limits."""
    from miles_engine import Engine, create_app

    engine = Engine(model, device="cpu", context_length=128, max_running_requests=8, prefill_wait_ms=0,
                    paused_request_timeout=2.0, weight_group_timeout=2.0, **options)
    try:
        with ThreadServer(create_app(engine, max_body_bytes=MAX_BODY)) as url, \
                httpx.Client(base_url=url, timeout=60, headers=auth_headers()) as client:
            yield Served(url, client, engine)
    finally:
        engine.shutdown()


