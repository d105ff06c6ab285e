"""Fixtures: the MoE layer map of the tiny random Qwen3-MoE (``tiny_moe`` and ``tiny_dense`` come
from the root conftest.py), and one real embedded engine serving the MoE on loopback (in a thread of
the test process) that every test of this package shares."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    import torch

    torch.set_num_threads(1)  # the suite shares 2 cores; tiny models gain nothing from more


@pytest.fixture(scope="session")
def moe_map(tiny_moe: Path) -> Any:
    from miles_model_qwen3.bridge import Qwen3Bridge

    return Qwen3Bridge().moe_layers(json.loads((tiny_moe / "config.json").read_text()))


@pytest.fixture(scope="session")
def moe_engine_url(tiny_moe: Path) -> Iterator[str]:
    """A real embedded engine serving the tiny MoE (fp32, CPU) over HTTP on loopback."""
    from miles_engine import Engine, create_app
    from miles_tito.server.background import BackgroundServer

    engine = Engine(tiny_moe, max_running_requests=8)
    try:
        with BackgroundServer(lambda: create_app(engine)) as server:
            yield server.url
    finally:
        engine.shutdown()
