"""Building a session server from a model name and an engine (or router) URL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_tito.families import resolve_family
from miles_tito.tokenizer import RenderCheck, TitoTokenizer

UPSTREAM_CONNECTIONS = 1024
"""Most connections from one session server to the router; more concurrent requests wait for one."""


def load_tito(model: str | Path, family: str | None = None, render_check: RenderCheck = "window") -> TitoTokenizer:
    """The TITO tokenizer of ``model`` (a ``miles models list`` name or a folder)."""
    from miles_models import resolve_model
    from transformers import AutoTokenizer

    path = resolve_model(str(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    return TitoTokenizer(tokenizer, resolve_family(family, path), render_check=render_check)


def app_factory(engine_url: str, tito: TitoTokenizer, *, model_name: str, **options: Any) -> Callable[[], Any]:
    """A function that builds the app (call it in the thread or process that serves it).

    :param options: keyword arguments of :class:`~miles_tito.server.service.SessionService`.
    """

    def make() -> Any:
        from miles.engine_client import HttpEngineClient

        from miles_tito.server.app import create_app
        from miles_tito.server.service import SessionService

        # One pool for all sessions (its cost does not grow with its connections); room for a
        # request in flight per session at the concurrencies agentic rollouts run.
        engine = HttpEngineClient(engine_url, retries=1, max_connections=UPSTREAM_CONNECTIONS)
        return create_app(SessionService(engine, tito, model_name=model_name, **options))

    return make
