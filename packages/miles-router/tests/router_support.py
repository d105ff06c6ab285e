"""Helpers of the router tests.

``StandinEngine`` is a minimal HTTP server speaking the engine wire protocol (``/generate``,
``/health``, ``/model_info``, the fan-out endpoints). It is a stand-in used ONLY by the
router-logic tests, where the test must control an engine precisely (hold requests to measure
load balancing, refuse a weight update, report a given weight_version). Everything the router does
against real engines -- generation, SIGKILL failover, re-admission -- is tested with real
``miles serve engine`` processes in test_reliability.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from miles_contracts.testing.processes import wait_ready


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """A uvicorn server on a background thread, on a free loopback port."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_keep_alive=5))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadedServer:
        self.thread.start()
        wait_ready(lambda: bool(self.server.started), f"the test server on port {self.port} to start",
                   alive=self.thread.is_alive, interval_s=0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


class StandinEngine:
    """See the module docstring. Controlled from the test thread through its attributes."""

    def __init__(self, version: str = "0") -> None:
        self.version = version
        self.healthy = True
        self.release = threading.Event()  # /generate waits until set
        self.release.set()
        self.refuse: set[str] = set()  # paths answered with HTTP 400 {"success": false}
        self.received: list[tuple[str, Any]] = []
        self.paused = False
        self.server = ThreadedServer(self._app())

    @property
    def url(self) -> str:
        return self.server.url

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info() -> dict:
            return {"model_path": "standin", "weight_version": self.version}

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.received.append(("/generate", body))
            while not self.release.is_set():
                await asyncio.sleep(0.005)
            ids = body.get("input_ids") or [0]
            answer = {"text": "ab", "output_ids": [5, 6],
                      "meta_info": {"id": body.get("rid") or "r", "finish_reason": {"type": "length", "length": 2},
                                    "prompt_tokens": len(ids), "completion_tokens": 2, "weight_version": self.version}}
            if body.get("stream"):
                async def events() -> Any:
                    for text in ("a", "ab"):
                        yield f"data: {json.dumps({**answer, 'text': text})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            return answer

        @app.post("/{path}")
        async def control(path: str, request: Request) -> JSONResponse:
            raw = await request.body()
            body = await request.json() if raw else {}
            self.received.append(("/" + path, body))
            if "/" + path in self.refuse:
                return JSONResponse({"success": False, "message": f"standin refuses /{path}"}, status_code=400)
            if path == "update_weight_version":
                self.version = body["new_version"]
            elif path.startswith("update_weights_from"):
                self.version = body.get("weight_version") or str(int(self.version) + 1)
            elif path in ("pause_generation", "continue_generation"):
                self.paused = path == "pause_generation"
            return JSONResponse({"success": True, "message": f"{path} done"})

        return app

    def paths(self) -> list[str]:
        return [path for path, _ in self.received]


class DroppingServer:
    """Answers ``/health`` and ``/model_info`` like an engine, but closes the connection on
    ``/generate`` without answering (or, for a streamed request, after the first event): an engine
    that dies with the request in hand."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dropped = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_until_complete(self._server.serve_forever())
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = await reader.readexactly(length)
                if b"/generate" in head.split(b"\r\n")[0]:
                    self.dropped += 1
                    if b'"stream": true' in body:  # start answering, then die mid-stream
                        event = b'data: {"text": 1}\n\n'
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n"
                                     + f"{len(event):x}\r\n".encode() + event + b"\r\n")
                        await writer.drain()
                    break
                payload = b'{"model_path": "dropper", "weight_version": "0"}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def start(self) -> DroppingServer:
        self.thread.start()
        wait_ready(self._ready.is_set, f"the dropping server on port {self.port} to listen", alive=self.thread.is_alive,
                   interval_s=0.01)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self.thread.join(timeout=10)


@contextmanager
def running(*servers: Any) -> Iterator[None]:
    started = []
    try:
        for server in servers:
            (server.server if isinstance(server, StandinEngine) else server).start()
            started.append(server)
        yield
    finally:
        for server in started:
            if isinstance(server, StandinEngine):
                server.release.set()  # a test that failed mid-way must not leave requests held
                server.server.stop()
            else:
                server.stop()


def wait_until(predicate: Any, timeout: float = 15.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` (a condition on the system, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout}s: {predicate}")
        time.sleep(interval)


@contextmanager
def router_for(workers: list[str], middlewares: list[Any] | None = None, **settings: Any) -> Iterator[Any]:
    """A router on a background thread (health probes every minute unless ``health_interval`` is
    given, so a test decides when probes matter) and an HTTP client for it."""
    import httpx
    from miles_contracts.wire.auth import auth_headers
    from miles_router import RouterServer
    from miles_router.config import RouterSection

    section = RouterSection(**{"health_interval": 60.0, **settings})
    with RouterServer(workers, section=section, middlewares=middlewares) as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=auth_headers()) as client:
        client.server = server
        yield client


def worker_view(client: Any, url: str) -> dict[str, Any]:
    return next(w for w in client.get("/list_workers").json()["workers"] if w["url"] == url)


def in_background(calls: list[Any]) -> list[Any]:
    """Start each zero-argument call on its own thread; returns futures."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=max(1, len(calls)))
    futures = [pool.submit(call) for call in calls]
    pool.shutdown(wait=False)
    return futures
