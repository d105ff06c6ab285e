"""Miles' embedded inference engine: continuous batching over a transformers causal LM, served
with SGLang's native HTTP API.

``Engine`` is the in-process API, ``create_app(engine)`` the ASGI app (FastAPI, with ``/generate``
on a plain-ASGI fast path), ``miles serve engine`` the command. Imports are lazy: ``import miles_engine`` loads neither torch nor FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_engine.config import EngineConfig
    from miles_engine.engine import BadRequestError, Engine
    from miles_engine.server import create_app

__all__ = ["BadRequestError", "Engine", "EngineConfig", "create_app"]
_HOMES = {"Engine": "miles_engine.engine", "BadRequestError": "miles_engine.engine",
          "EngineConfig": "miles_engine.config", "create_app": "miles_engine.server"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'miles_engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
