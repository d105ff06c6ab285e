"""Building a session server from a model name and an engine (or router) URL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_tito.families import resolve_family
from miles_tito.tokenizer import RenderCheck, TitoTokenizer

if TYPE_CHECKING:
    from miles.kernel import Kernel

UPSTREAM_CONNECTIONS = 1024
"""Most connections from one session server to the router; more concurrent requests wait for one."""


def load_tito(model: str | Path, family: str | None = None, render_check: RenderCheck = "window", *,
              kernel: Kernel) -> TitoTokenizer:
    """The TITO tokenizer of ``model`` (a ``miles models list`` name or a folder), with the chat
    family ``family`` (default: the one the model's bridge names) of ``kernel`` (this process's)."""
    from miles_models import resolve_model
    from transformers import AutoTokenizer

    path = resolve_model(str(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return TitoTokenizer(tokenizer, resolve_family(family, path, kernel=kernel), render_check=render_check)


def app_factory(engine_url: str, tito: TitoTokenizer, *, model_name: str, auth_token: str | None = None,
                max_body_bytes: int | None = None, allowed_hosts: Sequence[str] = (),
                **options: Any) -> Callable[[], Any]:
    """A function that builds the app (call it in the thread or process that serves it).

    :param auth_token: what callers must send and what the server sends upstream (default: the run's).
    :param allowed_hosts: host names the guard accepts besides addresses and ``localhost``.
    :param options: keyword arguments of :class:`~miles_tito.server.service.SessionService`.
    """

    def make() -> Any:
        from miles.engine_client import HttpEngineClient

        # One pool for all sessions (its cost does not grow with its connections); room for a
        # request in flight per session at the concurrencies agentic rollouts run.
        from miles_contracts.wire.auth import ensure_run_token
        from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES

        from miles_tito.server.app import create_app
        from miles_tito.server.service import SessionService

        token = auth_token or ensure_run_token()
        engine = HttpEngineClient(engine_url, retries=1, max_connections=UPSTREAM_CONNECTIONS, auth_token=token)
        return create_app(SessionService(engine, tito, model_name=model_name, **options), auth_token=token,
                          max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, allowed_hosts=allowed_hosts)

    return make
