"""Fixtures of the agent examples' tests: one engine on the tiny random model for the whole test
session and a session server in front of it; the end-to-end tests' ``miles train`` runs, started
together (helpers in ``example_support.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from example_support import TrainRuns

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


@pytest.fixture(scope="session")
def train_runs(request: pytest.FixtureRequest, tiny_dense: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainRuns]:
    """The ``miles train`` run of every test of this session that uses this fixture and is not
    skipped, all started when the first of these tests begins: each test then waits for its own
    (``train_runs.finished(CONFIG, *OVERRIDES)``) while the others' runs go on. A test names its run
    in its module's ``CONFIG`` and ``OVERRIDES``; a run no test announced starts when it is asked for."""
    from example_support import TrainRuns

    runs = TrainRuns(tiny_dense, tmp_path_factory.mktemp)
    try:
        for item in request.session.items:
            if isinstance(item, pytest.Function) and "train_runs" in item.fixturenames and not _skipped(item):
                runs.start(item.module.CONFIG, *getattr(item.module, "OVERRIDES", ()))
        yield runs
    finally:
        runs.stop()


def _skipped(item: pytest.Item) -> bool:
    """A ``skip`` mark, or a ``skipif`` mark with a condition that is true (conditions written as
    strings are not evaluated here: such a test's run starts anyway)."""
    def true(mark: pytest.Mark) -> bool:
        conditions = [*mark.args, *([mark.kwargs["condition"]] if "condition" in mark.kwargs else [])]
        return any(not isinstance(condition, str) and bool(condition) for condition in conditions)

    return any(mark.name == "skip" or (mark.name == "skipif" and true(mark)) for mark in item.iter_markers())
