"""Servers for the security suite: a real engine (tiny random model), a router and a session server,
each a real uvicorn server on a loopback port in this process, shared by the whole suite
(tests that change a server, such as pausing the engine, restore it).

The engine runs with small limits (a 1 MiB body limit, a 128-token context, 2 s pause and
weight-group timeouts) so that every limit can be reached cheaply.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from miles_contracts.wire.auth import auth_headers

sys.path.insert(0, str(Path(__file__).parent))

from security_support import MAX_BODY, Served, serve_engine  # noqa: E402


@pytest.fixture(scope="session")
def engine(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_engine(tiny_dense, weight_dir=[str(tmp_path_factory.getbasetemp() / "allowed")])


@pytest.fixture(scope="session")
def router(engine: Served) -> Iterator[Served]:
    from miles_router import RouterServer
    from miles_router.config import RouterSection

    # the router's own limit, as small as the engine's: a body over it is the router's 413, whatever
    # the router thinks of its engine (a test that rolls the engine's version back leaves it stale)
    with RouterServer([engine.url], section=RouterSection(health_interval=0.2, health_timeout=5.0),
                      max_body_bytes=MAX_BODY) as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=auth_headers()) as client:
        yield Served(server.url, client, server.router)


@pytest.fixture(scope="session")
def session_server(engine: Served, tiny_dense: Path) -> Iterator[Served]:
    from miles.context import context_for
    from miles_tito.server.background import BackgroundServer
    from miles_tito.server.factory import app_factory, load_tito

    tito = load_tito(tiny_dense, "chatml", kernel=context_for().kernel)
    make = app_factory(engine.url, tito, model_name="tiny", max_context_len=128, default_max_tokens=4,
                       max_body_bytes=MAX_BODY)
    with BackgroundServer(make) as server, \
            httpx.Client(base_url=server.url, timeout=60, headers=auth_headers()) as client:
        yield Served(server.url, client)
