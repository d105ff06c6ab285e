"""The engine health probe the loop runs before every weight sync, against real loopback servers."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from miles.loop.services import _healthy


def _serve(status: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
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
