"""``miles serve engine`` (also ``python -m miles_engine``): load a model and serve the HTTP API."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence

from miles.server_process import add_server_security_arguments, stop_within

from miles_engine.options import ENGINE_FLAGS

SHUTDOWN_GRACE_S = 5.0
"""After SIGTERM/SIGINT the process exits within this many seconds, whatever it was blocked in."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a model name of `miles models list` (pulled on first use) or a Hugging Face folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bf16 on CUDA, fp32 on CPU")
    for flag in ENGINE_FLAGS:
        flag.add_to(parser)
    add_server_security_arguments(parser)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles_contracts.wire.auth import server_token
    from miles_models import resolve_model

    from miles_engine.engine import Engine
    from miles_engine.server import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = server_token(args.auth_token, name="engine")
    path = resolve_model(args.model, auto_pull=True)
    options = {flag.name: getattr(args, flag.name) for flag in ENGINE_FLAGS if getattr(args, flag.name) is not None}
    engine = Engine(path, device=args.device, dtype=args.dtype, background=False, **options)
    app = create_app(engine, auth_token=token, max_body_bytes=int(args.max_body_mb * 2**20))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=60, timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    # HTTP on a helper thread, the scheduler on the main thread (see Scheduler.run for why).
    http = threading.Thread(target=server.run, name="miles-engine-http", daemon=True)

    def stop() -> None:  # from the watchdog thread: both loops end on their own flags
        server.should_exit = True
        engine.scheduler.stop()

    # The main thread may be inside a long C call (a forward, a collective) when the signal comes;
    # the watchdog sees it at once, asks both loops to stop, and exits the process after the grace.
    stop_within(SHUTDOWN_GRACE_S, stop)
    http.start()
    print(f"miles engine: {path} on {engine.loaded.device} ({engine.loaded.dtype}), "
          f"serving http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        engine.scheduler.run()
    finally:
        server.should_exit = True
        http.join(10)
        engine.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from miles.errors import MilesError

    parser = argparse.ArgumentParser(prog="python -m miles_engine", description="Serve the Miles embedded engine.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (MilesError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
