"""Fixtures of the engine tests: tiny random models served by real uvicorn servers on loopback
(helpers live in engine_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from miles_models.testing import tiny_model

sys.path.insert(0, str(Path(__file__).parent))

from engine_support import serve_engine  # noqa: E402


@pytest.fixture(scope="session")
def dense_path():
    return tiny_model("dense")


@pytest.fixture(scope="session")
def moe_path():
    return tiny_model("moe")


@pytest.fixture(scope="module")
def dense(dense_path):
    with serve_engine(dense_path, max_running_requests=32) as running:
        yield running


@pytest.fixture(scope="module")
def moe(moe_path):
    with serve_engine(moe_path, max_running_requests=16) as running:
        yield running
