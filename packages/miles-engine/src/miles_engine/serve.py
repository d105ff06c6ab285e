"""``miles serve engine`` (also ``python -m miles_engine``): load a model and serve the HTTP API.

Settings come from ``--config`` (a run passes its folder's ``config.yaml``: the ``engine``
section, ``model.device`` / ``model.dtype``, ``run.deterministic``, and the ``plugins`` section
the process loads its kernel for), then from the flags derived from those sections. Only what the
launch decides is a flag of its own: ``--model`` (the resolved folder), ``--host``, ``--port``,
``--run-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from miles.server_process import add_run_arguments, add_server_security_arguments, server_main, stop_within

STATS_PREFIX = "miles engine: stopped; stats "
"""The start of the line a stopping engine writes its batching statistics on (JSON after it)."""

SHUTDOWN_GRACE_S = 5  # whole seconds: uvicorn takes timeout_graceful_shutdown as an int
"""After SIGTERM/SIGINT the process exits within this many seconds, whatever it was blocked in;
requests in flight get one second less, so the engine's own shutdown fits in."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles.cli.section_args import add_section_arguments
    from miles.sections import ModelSection, RunSection

    from miles_engine.options import EngineSection

    parser.add_argument("--model", default=None,
                        help="a model name of `miles models list` (pulled on first use) or a Hugging Face folder "
                             "(default: the config's model.name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    add_run_arguments(parser)
    add_section_arguments(parser, "model", ModelSection, only=("device", "dtype"), title="model settings")
    add_section_arguments(parser, "run", RunSection, only=("deterministic",), title="run settings",
                          flags={"deterministic": "--enable-deterministic-inference"})
    add_section_arguments(parser, "engine", EngineSection, title="engine settings")
    add_server_security_arguments(parser)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles.server_process import allowed_hosts, bind_socket, context_from_args, listen_on, serve_on_thread
    from miles_contracts.wire.auth import server_token
    from miles_models import resolve_model

    from miles_engine.config import engine_config_of
    from miles_engine.engine import Engine
    from miles_engine.server import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Bind before loading the model: a taken port ends the process in seconds (exit status 98, the
    # executor picks another port), not after a load of minutes; and from here the port is ours.
    sock = bind_socket(args.host, args.port)
    ctx = context_from_args(args, "engine")
    token = server_token(args.auth_token, name="engine")
    path = resolve_model(args.model or ctx.config.model.name, auto_pull=True)
    settings = engine_config_of(ctx.config, path, run_dir=ctx.run_dir.resolve() if ctx.run_dir else None)
    engine = Engine.from_config(settings, background=False)
    app = create_app(engine, auth_token=token, max_body_bytes=int(args.max_body_mb * 2**20),
                     allowed_hosts=allowed_hosts(args))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=60, timeout_graceful_shutdown=SHUTDOWN_GRACE_S - 1))

    def stop() -> None:  # from the watchdog thread: both loops end on their own flags
        server.should_exit = True
        engine.scheduler.stop()

    # The main thread may be inside a long C call (a forward, a collective) when the signal comes;
    # the watchdog sees it at once, asks both loops to stop, and exits the process after the grace.
    stop_within(SHUTDOWN_GRACE_S, stop)
    try:
        listen_on(sock)
        # HTTP on a helper thread, the scheduler on the main thread (see Scheduler.run for why).
        http = serve_on_thread(server, sock, name="miles-engine-http")
    except BaseException:
        engine.shutdown()
        raise
    print(f"miles engine: {path} on {engine.loaded.device} ({engine.loaded.dtype}), "
          f"serving http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    try:
        engine.scheduler.run()
    finally:
        server.should_exit = True
        http.join(10)
        engine.shutdown()
        # how the engine spent its life (decode steps and their batch, prefills and their time): what
        # a benchmark reads from the run's logs after the process is gone (miles_longtail.report)
        print(f"{STATS_PREFIX}{json.dumps(engine.scheduler.stats.as_dict())}", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # a ValueError here is a bad engine option (the engine's config refuses it)
    return server_main("python -m miles_engine", "Serve the Miles embedded engine.", add_arguments, run, argv,
                       errors=(ValueError,))
