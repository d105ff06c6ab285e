"""Building a session server from a model name and an engine (or router) URL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_tito.families import resolve_family
from miles_tito.tokenizer import RenderCheck, TitoTokenizer


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
        from miles_tito.server.app import create_app
        from miles_tito.server.service import SessionService
        from miles_tito.server.upstream import ShardedEngineClient

        engine = ShardedEngineClient(engine_url)
        return create_app(SessionService(engine, tito, model_name=model_name, **options))

    return make
