"""``miles serve engine`` (also ``python -m miles_engine``): load a model and serve the HTTP API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from miles_engine.options import ENGINE_FLAGS


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
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles_models import resolve_model

    from miles_engine.engine import Engine
    from miles_engine.server import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = resolve_model(args.model, auto_pull=True)
    options = {flag.name: getattr(args, flag.name) for flag in ENGINE_FLAGS if getattr(args, flag.name) is not None}
    engine = Engine(path, device=args.device, dtype=args.dtype, background=False, **options)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_keep_alive=60))
    # HTTP on a helper thread, the scheduler on the main thread (see Scheduler.run for why).
    http = threading.Thread(target=server.run, name="miles-engine-http", daemon=True)

    def on_signal(signum: int, frame: object) -> None:
        engine.scheduler.stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
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
