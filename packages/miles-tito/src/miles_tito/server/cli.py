"""``miles serve session --router URL [--model NAME_OR_PATH] [--config FILE] --port N`` (also
``python -m miles_tito.server``).

Settings come from ``--config`` (a run passes its folder's ``config.yaml``): the ``tito`` section
(family, render check, rollback, idle timeout), ``rollout.max_context_len`` and
``rollout.max_new_tokens`` (the default completion budget), the run's loop mode (partial rollout
under ``run.mode: fully_async``), and the ``plugins`` section the process loads its kernel for --
the kernel whose chat families it resolves. Flags derived from those keys override the file. Only
what the launch decides is a flag of its own: ``--router``, ``--model``, ``--host``, ``--port``,
``--run-dir``.
"""

from __future__ import annotations

import argparse
import gc
from typing import TYPE_CHECKING

from miles.server_process import add_run_arguments, add_server_security_arguments, server_main

if TYPE_CHECKING:
    from miles_contracts import RunContext

    from miles_tito.config import TitoSection
    from miles_tito.conversation import EpisodeLimits

SHUTDOWN_GRACE_S = 5  # whole seconds: uvicorn takes timeout_graceful_shutdown as an int
"""After SIGTERM/SIGINT the server exits within this many seconds; requests still in flight get one
second less, so its own shutdown fits in."""

TITO_KEYS = ("family", "render_check", "max_branches_per_episode", "max_sessions_per_episode", "max_tokens_per_episode",
             "session_idle_timeout")
"""Keys of the ``tito`` section the session server reads (the rest are the generators')."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles.cli.section_args import add_section_arguments
    from miles.sections import RolloutSection

    from miles_tito.config import TitoSection

    parser.add_argument("--router", required=True, help="URL of the router (or of a single engine)")
    parser.add_argument("--model", default=None,
                        help="model the engines serve (name or folder): its tokenizer and chat family "
                             "(default: the config's model.name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30100)
    add_run_arguments(parser)
    add_section_arguments(parser, "tito", TitoSection, only=TITO_KEYS, title="tito settings")
    add_section_arguments(parser, "rollout", RolloutSection, only=("max_context_len", "max_new_tokens"),
                          flags={"max_new_tokens": ("--max-new-tokens", "--max-tokens")}, title="rollout settings")
    parser.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=None,
                        help="continue a turn a weight update aborted with the tokens it has instead of answering "
                             "'aborted, retry' (default: as the config's loop mode says: on under run.mode "
                             "fully_async with rollout.partial_rollout)")
    add_server_security_arguments(parser)
    parser.add_argument("--log-level", default="warning")


def session_options(ctx: RunContext, partial_rollout: bool | None = None) -> dict[str, object]:
    """Keyword arguments of :class:`~miles_tito.server.service.SessionService` for the run ``ctx``
    describes: the limits the in-process server of the ``agentic`` generator would enforce."""
    from miles.loop.modes import loop_mode

    from miles_tito.config import TitoSection

    config = ctx.config
    tito = config.section("tito", TitoSection)
    if partial_rollout is None:
        partial_rollout = loop_mode(config).partial_rollout(config)
    return {"max_context_len": config.rollout.max_context_len, "default_max_tokens": config.rollout.max_new_tokens,
            "episode_limits": episode_limits(tito), "idle_timeout": tito.session_idle_timeout or None,
            "partial_rollout": partial_rollout}


def episode_limits(tito: TitoSection) -> EpisodeLimits:
    from miles_tito.conversation import EpisodeLimits

    return EpisodeLimits(max_branches=tito.max_branches_per_episode, max_sessions=tito.max_sessions_per_episode,
                         max_tokens=tito.max_tokens_per_episode)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles.server_process import allowed_hosts, bind_socket, context_from_args, listen_on, stop_within
    from miles_contracts.wire.auth import server_token

    from miles_tito.config import TitoSection
    from miles_tito.server.factory import app_factory, load_tito

    sock = bind_socket(args.host, args.port)  # first: a taken port ends the start at once (exit status 98)
    ctx = context_from_args(args, "session")
    tito_section = ctx.config.section("tito", TitoSection)
    token = server_token(args.auth_token, name="session server")
    model = args.model or ctx.config.model.name
    tito = load_tito(model, tito_section.family, tito_section.render_check, kernel=ctx.kernel)
    make = app_factory(args.router, tito, model_name=str(model), auth_token=token,
                       max_body_bytes=int(args.max_body_mb * 2**20), allowed_hosts=allowed_hosts(args),
                       **session_options(ctx, args.partial_rollout))
    app = make()
    # Everything loaded so far (transformers, the tokenizer: ~400k objects) lives as long as the
    # process. Frozen, the collector stops re-scanning it: a full collection took ~180 ms, a pause
    # every request in flight would wait out.
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S - 1))

    def stop() -> None:
        server.should_exit = True

    stop_within(SHUTDOWN_GRACE_S, stop)
    listen_on(sock)
    print(f"session server: {model} (chat family {tito.family.name}) listening on "
          f"http://{args.host}:{sock.getsockname()[1]}, engines at {args.router}", flush=True)
    server.run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m miles_tito.server``."""
    return server_main("python -m miles_tito.server", "Serve the Miles session server.", add_arguments, run, argv)
