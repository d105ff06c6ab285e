"""Fixtures of the miles-ray tests: one real Ray cluster for the session (see ray_support.py)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from ray_support import LocalRayCluster  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    """A head with 2 stand-in GPUs, then two nodes with 1 each."""
    root = Path(tempfile.mkdtemp(prefix="mrt-", dir="/tmp"))  # short: Ray's socket paths are bounded
    cluster = LocalRayCluster(root)
    try:
        cluster.add("head", 2, head=True)
        cluster.add("a", 1)
        cluster.add("b", 1)
        cluster.wait_members({"head": 2, "a": 1, "b": 1})
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")
