"""Constants and helpers the security tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import socket

MAX_BODY = 1 << 20
"""The body limit the suite's servers run with (1 MiB): small enough to reach cheaply."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
