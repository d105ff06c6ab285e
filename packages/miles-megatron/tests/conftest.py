"""Fixtures of the miles-megatron tests: tiny real models and configs that build real backends."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a host with CUDA, skip the tests that build CPU backends: megatron-core cannot run a CPU
    model there (the backend refuses with a clear error); the ``gpu`` tests run instead."""
    import torch

    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="builds a CPU megatron backend, which megatron-core cannot run on a host with CUDA")
    builders = {"backend_factory", "make_config", "ranks"}
    for item in items:
        if item.get_closest_marker("gpu"):
            continue
        if builders & set(getattr(item, "fixturenames", ())) or item.module.__name__.endswith("test_train_e2e"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    import torch

    torch.set_num_threads(1)  # the suite shares 2 cores; tiny models gain nothing from more


@pytest.fixture
def make_config() -> Callable[..., Any]:
    """``make_config(model_dir, megatron={...}, **train_fields)``: a CPU config for a tiny model."""
    from miles_megatron.testing import config_for

    return config_for


@pytest.fixture
def backend_factory(make_config) -> Iterator[Callable[..., Any]]:
    """``backend_factory(model_dir, kernel=None, **config)``: real backends (trainer rank 0 of a run of
    ``kernel``, default the config's plugin selection), all closed at teardown."""
    from miles.context import context_for
    from miles_contracts import Process
    from miles_megatron.backend import MegatronBackend

    made: list[MegatronBackend] = []

    def build(model_dir: Path, *, kernel: Any = None, **kwargs: Any) -> MegatronBackend:
        backend = MegatronBackend(context_for(make_config(model_dir, **kwargs), Process.trainer_rank(0), kernel=kernel))
        made.append(backend)
        return backend

    yield build
    for backend in reversed(made):
        backend.close()
