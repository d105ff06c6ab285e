"""Shared fixtures: the tiny models' SmolLM2 tokenizer and TITO tokenizers of both families."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tokenizer(tiny_dense: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dense)


@pytest.fixture(scope="session")
def chatml(tokenizer: Any) -> Any:
    from miles.kernel import Kernel
    from miles_tito.families import resolve_family
    from miles_tito.tokenizer import TitoTokenizer

    return TitoTokenizer(tokenizer, resolve_family("chatml", kernel=Kernel.load()))


@pytest.fixture(scope="session")
def qwen3(tokenizer: Any) -> Any:
    from miles.kernel import Kernel
    from miles_tito.families import resolve_family
    from miles_tito.tokenizer import TitoTokenizer

    return TitoTokenizer(tokenizer, resolve_family("qwen3", kernel=Kernel.load()))


@pytest.fixture(scope="session")
def engine_url(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real embedded engine on the tiny random Llama (subprocess, one per test session)."""
    from tito_support import engine_process

    with engine_process(str(tiny_dense), tmp_path_factory.mktemp("tito-engine") / "engine.log") as url:
        yield url


@pytest.fixture(scope="session")
def router_url(engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real router in front of the engine."""
    from tito_support import router_process

    with router_process(engine_url, log=tmp_path_factory.mktemp("tito-router") / "router.log") as url:
        yield url


@pytest.fixture(scope="module")
def calls_server(router_url: str, chatml: Any) -> Any:
    """A session server behind the router whose every model turn is read as a calculator call
    (see tito_support.always_calls). test_generators.py has its own, straight to the engine."""
    from miles_tito.tokenizer import TitoTokenizer
    from tito_support import always_calls, family_with_parser, session_server

    tito = TitoTokenizer(chatml.tokenizer, family_with_parser(chatml.family, always_calls, "calls"))
    with session_server(router_url, tito) as url:
        yield url


@pytest.fixture(scope="module")
def chat_server(router_url: str, chatml: Any) -> Any:
    """A session server behind the router, ChatML, the model's own text as the reply."""
    from tito_support import session_server

    with session_server(router_url, chatml) as url:
        yield url


@pytest.fixture(scope="module")
def thinking_server(router_url: str, chatml: Any) -> Any:
    """A session server behind the router whose every turn reads as a thought and a calculator call
    (tito_support.thinks_then_calls)."""
    from miles_tito.tokenizer import TitoTokenizer
    from tito_support import family_with_parser, session_server, thinks_then_calls

    tito = TitoTokenizer(chatml.tokenizer, family_with_parser(chatml.family, thinks_then_calls, "thinks"))
    with session_server(router_url, tito) as url:
        yield url
