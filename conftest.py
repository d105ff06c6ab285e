"""Repo-wide pytest setup: offline model hub, a run token, the `gpu` marker skips without CUDA, and
the tiny random models of ``miles_models.testing`` as fixtures."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_dense() -> Path:
    """miles-models' tiny Llama (tied embeddings, 4 heads in 2 groups, SmolLM2's vocabulary)."""
    from miles_models.testing import tiny_model

    return tiny_model("dense")


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """miles-models' tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2)."""
    from miles_models.testing import tiny_model

    return tiny_model("moe")
