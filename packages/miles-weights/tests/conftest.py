"""Real engines for the end-to-end tests: ``miles serve engine`` processes on the tiny dense model.

Started once per session (each takes a few seconds to import torch and load), shut down after.
Three CPU engines: two sync targets and one reference that is never updated, whose greedy output
is what an engine loaded from the same weights generates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from miles_weights.launch import RunningEngines


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


@pytest.fixture(scope="session")
def cpu_engine_processes(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngines]:
    from miles_weights.launch import EngineLaunch, running_engines

    launches = [EngineLaunch("cpu", "float32")] * 3
    # the disk transport of the tests writes under the session's temporary folders; CPU engines
    # start together (their start-ups overlap)
    with running_engines(tiny_dir, launches, tmp_path_factory.mktemp("engines"),
                         weight_dirs=[tmp_path_factory.getbasetemp()], together=True) as engines:
        yield engines


@pytest.fixture(scope="session")
def cpu_engines(cpu_engine_processes: RunningEngines) -> dict[str, str]:
    """``a`` and ``b``: sync targets; ``reference``: never updated."""
    return dict(zip(["a", "b", "reference"], cpu_engine_processes.urls, strict=True))


@pytest.fixture(scope="session")
def trainer_tensors(tiny_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """What a trainer would push: the model's HF-named tensors, in the engines' dtype."""
    from miles_weights.bench_models import load_tensors

    return load_tensors(tiny_dir, torch.float32, "cpu")
