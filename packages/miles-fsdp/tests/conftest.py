"""Fixtures of the miles-fsdp tests: tiny real models and configs that build real backends."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _few_threads() -> None:
    import torch

    torch.set_num_threads(1)  # the suite shares 2 cores; tiny models gain nothing from more


@pytest.fixture
def make_config() -> Callable[..., Any]:
    """``make_config(model_dir, fsdp={...}, **train_fields)``: a CPU config for a tiny model."""
    from miles.config import MilesConfig
    from miles.sections import AlgorithmSection, ModelSection, RolloutSection, RunSection, TrainSection
    from miles_fsdp.config import FSDPSection

    def build(model_dir: Path, *, fsdp: dict[str, Any] | None = None, algorithm: dict[str, Any] | None = None,
              temperature: float = 1.0, steps: int = 8, **train: Any) -> MilesConfig:
        train.setdefault("lr", 1e-3)
        return MilesConfig(
            model=ModelSection(name=str(model_dir), device="cpu"),
            run=RunSection(steps=steps),
            rollout=RolloutSection(temperature=temperature),
            train=TrainSection(**train),
            algorithm=AlgorithmSection(**(algorithm or {})),
            extra={"fsdp": FSDPSection(**(fsdp or {}))},
        )

    return build


@pytest.fixture
def backend_factory(make_config) -> Callable[..., Any]:
    """``backend_factory(model_dir, kernel=None, **config)``: real backends (trainer rank 0 of a run of
    ``kernel``, default the config's plugin selection), all closed at teardown."""
    from miles.context import context_for
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend

    made: list[FSDPBackend] = []

    def build(model_dir: Path, *, kernel: Any = None, **kwargs: Any) -> FSDPBackend:
        backend = FSDPBackend(context_for(make_config(model_dir, **kwargs), Process.trainer_rank(0), kernel=kernel))
        made.append(backend)
        return backend

    yield build
    for backend in reversed(made):
        if backend.trained or backend.actor is not None:
            backend.close()
