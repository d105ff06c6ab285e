"""Running the sandbox service: as a run's process (``python -m miles_sandbox``, argv from
:func:`sandbox_command`), or on a thread of this process (:class:`SandboxServer`, tests and benchmarks)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from miles_sandbox.config import SandboxSection

SHUTDOWN_GRACE_S = 5


def sandbox_command(*, port: int, host: str = "127.0.0.1", config_path: str | Path | None = None,
                    run_dir: str | Path | None = None) -> list[str]:
    """argv of a process serving the sandbox service on ``host:port`` with the ``sandbox`` section of
    ``config_path`` (a run's ``config.yaml``)."""
    argv = [sys.executable, "-m", "miles_sandbox", "--host", host, "--port", str(port)]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if run_dir:
        argv += ["--run-dir", str(run_dir)]
    return argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles.server_process import add_run_arguments, add_server_security_arguments

    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30300)
    parser.add_argument("--log-level", default="warning")
    add_run_arguments(parser)
    add_server_security_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles.server_process import allowed_hosts, context_from_args, listen_socket, stop_within
    from miles_contracts.wire.auth import server_token

    from miles_sandbox.app import guarded_app
    from miles_sandbox.box import bwrap_path

    section = context_from_args(args, "sandbox").config.section("sandbox", SandboxSection)
    bwrap_path()  # no bubblewrap: fail at start, with how to install it
    token = server_token(args.auth_token, name="sandbox")
    sock = listen_socket(args.host, args.port)
    app = guarded_app(section, token, allowed_hosts(args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=5, timeout_graceful_shutdown=SHUTDOWN_GRACE_S - 1))

    def stop() -> None:
        server.should_exit = True

    stop_within(SHUTDOWN_GRACE_S, stop)
    server.run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    from miles.server_process import server_main

    return server_main("miles serve sandbox", "Sandboxed command execution for agents (bubblewrap).",
                       add_arguments, run, argv)


class SandboxServer:
    """The service on a daemon thread of this process::

        with SandboxServer(SandboxSection(pool_size=2), token=token) as server:
            SandboxClient(server.url, token=token)...
    """

    def __init__(self, section: SandboxSection, *, token: str, host: str = "127.0.0.1") -> None:
        self.section = section
        self.token = token
        self.host = host
        self._server: Any = None

    def __enter__(self) -> SandboxServer:
        import uvicorn
        from miles.server_process import listen_socket, serve_on_thread

        from miles_sandbox.app import guarded_app

        sock = listen_socket(self.host, 0)
        self.port = int(sock.getsockname()[1])
        self._server = uvicorn.Server(uvicorn.Config(guarded_app(self.section, self.token), log_level="warning",
                                                     timeout_graceful_shutdown=2))
        self._thread = serve_on_thread(self._server, sock, name="miles-sandbox")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(15)
