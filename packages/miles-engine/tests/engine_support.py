"""Test helpers: a real engine behind a real uvicorn server on a free loopback port.

The server runs in a thread of the test process (``uvicorn.Server``), so a test can also reach the
in-process engine (its model, for teacher-forced checks).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from miles_contracts.testing.processes import http_ok, wait_ready
from miles_contracts.wire.auth import auth_headers
from miles_engine import Engine, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningEngine:
    engine: Engine
    url: str
    client: httpx.Client

    def post(self, path: str, body: dict[str, Any] | None = None, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, json=body or {}, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.post("/generate", body)
        assert response.status_code == 200, response.text
        return response.json()

    def info(self) -> dict[str, Any]:
        return self.get("/get_server_info").json()


@contextmanager
def serve_engine(model_path: Path | str, **options: Any) -> Iterator[RunningEngine]:
    engine = Engine(model_path, **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=120, headers=auth_headers())
    try:
        wait_ready(http_ok(url + "/health"), f"the engine's server at {url} answering /health", alive=thread.is_alive)
        yield RunningEngine(engine, url, client)
    finally:
        client.close()
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def wait_until(predicate, timeout: float = 60.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError("condition not reached in time")
