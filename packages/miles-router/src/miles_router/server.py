"""Running the router: as a process (:func:`router_command` gives its argv), in the foreground
(:func:`serve`), or on a background thread of this process (:class:`RouterServer`)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_router.config import RouterSection
from miles_router.middleware import NamedMiddleware

if TYPE_CHECKING:
    from miles_contracts import RunContext


def router_command(workers: Sequence[str], *, port: int, host: str = "127.0.0.1",
                   config_path: str | Path | None = None, run_dir: str | Path | None = None,
                   extra: Sequence[str] = (), python: str | None = None) -> list[str]:
    """argv of a process serving the router on ``host:port`` in front of ``workers``.

    It runs ``python -m miles_router`` (``miles serve router`` without the rest of the CLI). Its
    settings are the ``router`` section of ``config_path`` (a run's ``config.yaml``; None: the
    defaults), whose ``plugins`` section also decides which middlewares it can build; ``extra``
    flags (``--health-interval 0.2`` ...) override keys of it.
    """
    argv = [python or sys.executable, "-m", "miles_router", "--host", host, "--port", str(port)]
    for url in workers:
        argv += ["--worker", url]
    if config_path is not None:
        argv += ["--config", str(config_path)]
    if run_dir:
        argv += ["--run-dir", str(run_dir)]
    return [*argv, *extra]


SHUTDOWN_GRACE_S = 5  # whole seconds: uvicorn takes timeout_graceful_shutdown as an int
"""After SIGTERM/SIGINT the router exits within this many seconds; requests still in flight get one
second less, so closing its clients fits in."""


def serve(workers: Sequence[str], *, port: int, host: str = "127.0.0.1", section: RouterSection | None = None,
          middlewares: Sequence[NamedMiddleware] | None = None, ctx: RunContext | None = None,
          log_level: str = "info", auth_token: str | None = None, max_body_bytes: int | None = None,
          allowed_hosts: Sequence[str] = ()) -> None:
    """Serve the router until SIGTERM or SIGINT (what ``miles serve router`` runs, on the main
    thread); ``middlewares`` is the chain (default: built from ``section`` by ``ctx``'s kernel, see
    :func:`~miles_router.app.create_app`). A port that is taken raises
    :class:`~miles.server_process.AddressInUse` before anything else is built."""
    import uvicorn
    from miles.server_process import listen_socket, stop_within
    from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES

    from miles_router.app import create_app

    sock = listen_socket(host, port)
    app = create_app(section, workers, middlewares, ctx=ctx, auth_token=auth_token,
                     max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, allowed_hosts=allowed_hosts)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S - 1))

    def stop() -> None:
        server.should_exit = True

    stop_within(SHUTDOWN_GRACE_S, stop)
    server.run(sockets=[sock])


class RouterServer:
    """The router on a background thread of this process, for notebooks and tests::

        with RouterServer(["http://127.0.0.1:30001"], port=0) as router:
            httpx.post(router.url + "/generate", json=...)

    ``port=0`` picks a free port. ``router.router`` is the live :class:`~miles_router.router.Router`.
    A section naming middlewares needs ``ctx`` (whose kernel builds them) or the built ``middlewares``.
    """

    def __init__(self, workers: Sequence[str] = (), *, port: int = 0, host: str = "127.0.0.1",
                 section: RouterSection | None = None, middlewares: Sequence[NamedMiddleware] | None = None,
                 ctx: RunContext | None = None, log_level: str = "warning", auth_token: str | None = None,
                 max_body_bytes: int | None = None) -> None:
        import uvicorn
        from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES

        from miles_router.app import create_app

        self.app = create_app(section, workers, middlewares, ctx=ctx, auth_token=auth_token,
                              max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        self.router = self.app.state.router
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                     timeout_keep_alive=5, timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._run, name="miles-router", daemon=True)
        self.host = host
        self.port = port
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> RouterServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"router failed to start on {self.host}:{self.port}: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"router did not start on {self.host}:{self.port} within {timeout}s")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
