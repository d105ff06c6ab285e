"""Fixtures of the router tests (helpers live in router_support.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from router_support import StandinEngine, running  # noqa: E402


@pytest.fixture
def engines() -> Iterator[list[StandinEngine]]:
    """Two stand-in engines (router-logic tests only; see router_support)."""
    pair = [StandinEngine(), StandinEngine()]
    with running(*pair):
        yield pair
