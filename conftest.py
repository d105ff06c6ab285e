"""Repo-wide pytest setup: offline model hub, a run token, and the `gpu` marker skips without CUDA."""

from __future__ import annotations

import os

import pytest
from miles_contracts.wire.auth import ensure_run_token

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# As under `miles train`: one token for the session, inherited by every server a test starts and
# sent by every Miles client; tests that talk HTTP themselves add `auth_headers()`.
ensure_run_token()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items) or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
