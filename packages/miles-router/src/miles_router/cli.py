"""``miles serve router`` (also ``python -m miles_router``): the router in front of engines given
with ``--worker``.

Settings come from ``--config`` (a run passes its folder's ``config.yaml``: the ``router``
section, and the ``plugins`` section the process loads its kernel for -- the kernel that builds
the middleware chain), then from the flags derived from :class:`~miles_router.config.RouterSection`
(``--health-interval``, ``--middleware`` ...). The whole config is validated, so a bad value fails
at start-up with every problem listed. Only what the launch decides is a flag of its own: the
workers, ``--host``, ``--port``, ``--run-dir``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from miles.errors import ConfigError
from miles.server_process import add_run_arguments, add_server_security_arguments, server_main

from miles_router.config import RouterSection

if TYPE_CHECKING:
    from miles_contracts import RunContext

ROUTER_FLAGS = {"middlewares": "--middleware"}
"""Option strings that are not the field's name (``--middleware NAME``, repeated)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles.cli.section_args import add_section_arguments

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="engine base URL, e.g. http://127.0.0.1:30001 (repeat for several)")
    add_run_arguments(parser)
    add_section_arguments(parser, "router", RouterSection, flags=ROUTER_FLAGS, title="router settings")
    add_server_security_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def context_of(args: argparse.Namespace) -> RunContext:
    """The router process's context: the config file with the flags on top, its kernel."""
    from miles.server_process import context_from_args

    return context_from_args(args, "router")


def section_from_args(args: argparse.Namespace) -> RouterSection:
    """The router settings the arguments describe (config file first, flags on top), validated."""
    return context_of(args).config.section("router", RouterSection)


def run(args: argparse.Namespace) -> int:
    from miles.server_process import allowed_hosts
    from miles_contracts.wire.auth import server_token

    from miles_router.middleware import build_middlewares
    from miles_router.server import serve
    from miles_router.workers import InvalidWorkerUrl, normalize_worker_url

    ctx = context_of(args)
    section = ctx.config.section("router", RouterSection)
    try:
        workers = [normalize_worker_url(url) for url in args.worker]
    except InvalidWorkerUrl as exc:
        raise ConfigError([f"--worker: {exc}"]) from None
    middlewares = build_middlewares(section.middlewares, section.middleware_options, ctx)
    token = server_token(args.auth_token, name="router")
    serve(workers, port=args.port, host=args.host, section=section, middlewares=middlewares, ctx=ctx, log_level=args.log_level,
          auth_token=token, max_body_bytes=int(args.max_body_mb * 2**20), allowed_hosts=allowed_hosts(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m miles_router``."""
    return server_main("python -m miles_router", __doc__.split("\n\n")[0], add_arguments, run, argv)
