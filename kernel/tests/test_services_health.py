"""The engine health probe the loop runs before every weight sync, against real loopback servers."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from miles.loop.services import Planned, Services, _healthy
from miles.placement import Node, Slot
from miles_contracts.cluster import ENGINE, Endpoint


def _serve(status: int, hits: list[str] | None = None) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if hits is not None:
                hits.append(self.path)
            code = status if self.path == "/health" else 404
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_health_probe_reads_the_status(status: int, healthy: bool) -> None:
    server = _serve(status)
    try:
        assert _healthy(f"http://127.0.0.1:{server.server_address[1]}") is healthy
        assert _healthy(f"http://127.0.0.1:{server.server_address[1]}/") is healthy  # trailing slash
    finally:
        server.shutdown()
        server.server_close()


def test_health_probe_of_a_closed_port_is_false() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert _healthy(f"http://127.0.0.1:{port}", timeout=2.0) is False


class _Executor:
    """Only what ``Services.wait_ready`` asks of an executor: whether a process is alive (and a
    restart, for ``handle_death``). The engine behind it is a real loopback server."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.restarted: list[str] = []

    def alive(self, name: str) -> bool:
        return True

    def restart(self, name: str, *, wait: bool = True) -> Endpoint:
        self.restarted.append(name)
        return self.endpoint

    def manifest(self) -> list[dict]:
        return []


def test_an_engine_seen_healthy_is_not_asked_again_until_it_restarts(tmp_path) -> None:
    # SGLang's /health generates a token (~1 s); the loop waits for engines before every rollout
    # and weight sync, so a probe there cost every step a second on the H200.
    hits: list[str] = []
    server = _serve(200, hits)
    endpoint = Endpoint("127.0.0.1", server.server_address[1])
    engine = SimpleNamespace(needs=(), role=ENGINE)
    services = Services(_Executor(endpoint), tmp_path, config=None, model_path=tmp_path,
                        planned={"engine-0": Planned("engine-0", ENGINE, engine, Slot(Node("n", "127.0.0.1", ())))},
                        urls={"engine-0": endpoint.url})
    try:
        services.wait_ready(10)
        assert hits == []  # started healthy (start_services waited), alive since: trusted
        services.wait_ready(10, probe=True)
        assert hits == ["/health"]  # asked for: probed
        assert services.handle_death("engine-0") and services.unconfirmed == {"engine-0"}
        assert services.stale_engines == {"engine-0"}
        services.wait_ready(10)
        assert hits == ["/health"] * 2 and services.unconfirmed == set()  # restarted: probed once, then trusted
        services.wait_ready(10)
        assert len(hits) == 2
    finally:
        server.shutdown()
        server.server_close()
