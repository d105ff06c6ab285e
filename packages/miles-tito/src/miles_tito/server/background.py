"""Serve an ASGI app from a background thread of this process, on a free loopback port.

Used where a session server must live inside another program: the ``agentic`` generator when the
run has no session server of its own, and the benchmarks. The app is built *inside* the server's
thread (``make_app`` is called there), so everything bound to an event loop -- locks, HTTP clients
-- belongs to the loop that serves it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any


class BackgroundServer:
    """``with BackgroundServer(make_app) as server: server.url``."""

    def __init__(self, make_app: Callable[[], Any], *, host: str = "127.0.0.1", startup_timeout: float = 30.0) -> None:
        self._make_app = make_app
        self._host = host
        self._startup_timeout = startup_timeout
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.url = ""

    def start(self) -> str:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        port = sock.getsockname()[1]
        ready = threading.Event()

        def serve() -> None:
            try:
                config = uvicorn.Config(self._make_app(), log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=5)
                self._server = uvicorn.Server(config)
                ready.set()
                self._server.run(sockets=[sock])
            except BaseException as exc:  # reported by start(), which waits for the thread
                self._error = exc
                ready.set()

        self._thread = threading.Thread(target=serve, name=f"miles-server-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        ready.wait(self._startup_timeout)
        while self._error is None and not (self._server is not None and self._server.started):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the background server on port {port} did not start within {self._startup_timeout}s")
            time.sleep(0.01)
        if self._error is not None:
            raise RuntimeError(f"the background server failed to start: {self._error}") from self._error
        self.url = f"http://{self._host}:{port}"
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
