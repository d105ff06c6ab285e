"""``miles serve session --router URL --model NAME_OR_PATH --port N``."""

from __future__ import annotations

import argparse
import gc
from typing import Any

from miles.server_process import add_server_security_arguments

SHUTDOWN_GRACE_S = 5.0
"""On SIGTERM, requests still in flight get this long before the server exits anyway."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="URL of the router (or of a single engine)")
    parser.add_argument("--model", required=True, help="model the engines serve (name or folder): its tokenizer and chat family")
    parser.add_argument("--family", help="chat family (default: the one the model's bridge names)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30100)
    parser.add_argument("--max-context-len", type=int, default=32768, help="prompt + completion limit in tokens")
    parser.add_argument("--max-tokens", type=int, default=1024, help="completion budget when a request sets none")
    parser.add_argument("--render-check", choices=["window", "full"], default="window",
                        help="history rendered around appended messages (full also catches templates that re-render old turns)")
    parser.add_argument("--max-rollback-turns", type=int, default=1, help="generated turns one request may retry")
    parser.add_argument("--session-idle-timeout", type=float, default=3600.0,
                        help="seconds without a request after which a session expires (0: never)")
    add_server_security_arguments(parser)
    parser.add_argument("--partial-rollout", action="store_true",
                        help="continue a turn a weight update aborted with the tokens it has (run.mode fully_async) "
                             "instead of answering 'aborted, retry'")
    parser.add_argument("--log-level", default="warning")


def session_arguments(config: Any) -> list[str]:
    """The flags a run's session server gets from its config, every setting spelled out.

    ``config`` is the run's ``MilesConfig``: the ``tito`` section (family, render check, rollback,
    idle timeout) and ``rollout.max_context_len`` / ``max_new_tokens``, so the server the kernel
    starts enforces what the in-process one of the ``agentic`` generator would.
    """
    from miles_tito.config import TitoSection

    section = config.section("tito", TitoSection)
    argv = ["--render-check", section.render_check, "--max-rollback-turns", str(section.max_rollback_turns),
            "--session-idle-timeout", repr(section.session_idle_timeout),
            "--max-context-len", str(config.rollout.max_context_len), "--max-tokens", str(config.rollout.max_new_tokens)]
    if section.family:
        argv += ["--family", section.family]
    if config.run.mode == "fully_async" and config.rollout.partial_rollout:
        argv.append("--partial-rollout")
    return argv


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from miles_contracts.wire.auth import server_token

    from miles_tito.server.factory import app_factory, load_tito

    token = server_token(args.auth_token, name="session server")
    tito = load_tito(args.model, args.family, args.render_check)
    make = app_factory(
        args.router, tito, model_name=str(args.model), auth_token=token, max_body_bytes=int(args.max_body_mb * 2**20),
        max_context_len=args.max_context_len,
        default_max_tokens=args.max_tokens, max_rollback_turns=args.max_rollback_turns,
        idle_timeout=args.session_idle_timeout or None, partial_rollout=args.partial_rollout,
    )
    app = make()
    # Everything loaded so far (transformers, the tokenizer: ~400k objects) lives as long as the
    # process. Frozen, the collector stops re-scanning it: a full collection took ~180 ms, a pause
    # every request in flight would wait out.
    gc.freeze()
    print(f"session server: {args.model} (chat family {tito.family.name}) on http://{args.host}:{args.port}, engines at {args.router}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
