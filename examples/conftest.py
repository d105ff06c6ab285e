"""Fixtures of the agent examples' tests: one engine on the tiny random model for the whole test
session and a session server in front of it (helpers in ``example_support.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def engine_url(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from example_support import engine

    with engine(tiny_dense, tmp_path_factory.mktemp("example-engine") / "engine.log") as url:
        yield url


@pytest.fixture(scope="session")
def session_server_url(engine_url: str, tiny_dense: Path) -> Iterator[str]:
    from example_support import session_server

    with session_server(engine_url, tiny_dense) as url:
        yield url
