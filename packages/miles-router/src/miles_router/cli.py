"""``miles serve router``: the router in front of engines given with ``--worker``.

Settings come from ``--config`` (its ``router`` section only) when given, then from the flags; the
result is validated as :class:`miles_router.config.RouterSection`, so a bad value fails at start-up
with every problem listed.
"""

from __future__ import annotations

import argparse
import json

from miles.errors import ConfigError
from miles.server_process import add_server_security_arguments

from miles_router.config import RouterSection

# flag -> RouterSection field, for flags that map one to one
_FIELD_FLAGS = {
    "health_interval": float, "failure_threshold": int, "health_timeout": float,
    "request_timeout": float, "max_attempts": int, "affinity_capacity": int, "forward_client": str,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="engine base URL, e.g. http://127.0.0.1:30001 (repeat for several)")
    parser.add_argument("--middleware", action="append", default=None, metavar="NAME",
                        help="registered router middleware, outermost first (repeat for several)")
    parser.add_argument("--middleware-options", default=None, metavar="JSON",
                        help='options per middleware, e.g. \'{"access_log": {"path": "router.jsonl"}}\'')
    defaults = RouterSection()
    for name, kind in _FIELD_FLAGS.items():
        field = RouterSection.model_fields[name]
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"{field.description or name} (default {getattr(defaults, name)})")
    parser.add_argument("--no-weight-version-check", action="store_true",
                        help="serve workers whatever their weight_version (default: hold back stale ones)")
    parser.add_argument("--config", default=None, help="a miles config whose `router` section to start from")
    add_server_security_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def section_from_args(args: argparse.Namespace) -> RouterSection:
    """The router settings the arguments describe (config file first, flags on top)."""
    settings: dict = {}
    if args.config:  # only the router section: the router does not need the rest to be valid
        from pathlib import Path

        from miles.config import read_yaml

        settings = dict(read_yaml(Path(args.config)).get("router") or {})
    if args.middleware is not None:
        settings["middlewares"] = args.middleware
    if args.middleware_options is not None:
        try:
            settings["middleware_options"] = json.loads(args.middleware_options)
        except ValueError as exc:
            raise ConfigError([f"--middleware-options is not valid JSON: {exc}"]) from None
    for name in _FIELD_FLAGS:
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    if args.no_weight_version_check:
        settings["check_weight_version"] = False
    try:
        return RouterSection.model_validate(settings)
    except ValueError as exc:  # pydantic's ValidationError
        errors = getattr(exc, "errors", None)
        lines = [f"router.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()] if errors else [str(exc)]
        raise ConfigError(lines) from None


def run(args: argparse.Namespace) -> int:
    from miles_contracts.wire.auth import server_token

    from miles_router.server import serve
    from miles_router.workers import InvalidWorkerUrl, normalize_worker_url

    section = section_from_args(args)
    try:
        workers = [normalize_worker_url(url) for url in args.worker]
    except InvalidWorkerUrl as exc:
        raise ConfigError([f"--worker: {exc}"]) from None
    token = server_token(args.auth_token, name="router")
    serve(workers, port=args.port, host=args.host, section=section, log_level=args.log_level, auth_token=token,
          max_body_bytes=int(args.max_body_mb * 2**20))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m miles_router``."""
    import sys

    from miles.errors import MilesError

    parser = argparse.ArgumentParser(prog="python -m miles_router", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except MilesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
