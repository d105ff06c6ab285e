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
