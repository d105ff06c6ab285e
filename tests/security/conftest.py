"""Servers for the security suite: a real engine (tiny random model), a router and a session server,
each a real uvicorn server on a loopback port in this process, shared by the tests of a module.

The engine runs with small limits (a 1 MiB body limit, a 128-token context, 2 s pause and
weight-group timeouts) so that every limit can be reached cheaply.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from miles_contracts.wire.auth import auth_headers

sys.path.insert(0, str(Path(__file__).parent))

from security_support import MAX_BODY, free_port  # noqa: E402


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
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="session")
def tiny_dense() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _engine(model: Path, **options: Any) -> Iterator[Served]:
    from miles_engine import Engine, create_app

    engine = Engine(model, device="cpu", context_length=128, max_running_requests=8, prefill_wait_ms=0,
                    paused_request_timeout=2.0, weight_group_timeout=2.0, **options)
    try:
        with ThreadServer(create_app(engine, max_body_bytes=MAX_BODY)) as url, \
                httpx.Client(base_url=url, timeout=60, headers=auth_headers()) as client:
            yield Served(url, client, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _engine(tiny_dense, weight_dir=[str(tmp_path_factory.getbasetemp() / "allowed")])


@pytest.fixture(scope="module")
def router(engine: Served) -> Iterator[Served]:
    from miles.sections import RouterSection
    from miles_router import RouterServer

    with RouterServer([engine.url], section=RouterSection(health_interval=0.2, health_timeout=5.0)) as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=auth_headers()) as client:
        yield Served(server.url, client, server.router)


@pytest.fixture(scope="module")
def session_server(engine: Served, tiny_dense: Path) -> Iterator[Served]:
    from miles_tito.server.background import BackgroundServer
    from miles_tito.server.factory import app_factory, load_tito

    tito = load_tito(tiny_dense, "chatml")
    make = app_factory(engine.url, tito, model_name="tiny", max_context_len=128, default_max_tokens=4,
                       max_body_bytes=MAX_BODY)
    with BackgroundServer(make) as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=auth_headers()) as client:
        yield Served(server.url, client)
