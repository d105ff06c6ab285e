"""WorkerPool: results in order, worker exceptions and missed deadlines become Failed, and a stuck
worker is replaced without failing other batches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from miles.rewards import Failed, WorkerPool


@pytest.fixture
def pool() -> Iterator[WorkerPool]:
    pool = WorkerPool(processes=2)
    yield pool
    pool.close()


def test_map_keeps_order_and_reports_exceptions(pool: WorkerPool) -> None:
    assert asyncio.run(pool.map(abs, [-3, 2, -1], timeout=60)) == [3, 2, 1]
    results = asyncio.run(pool.map(int, ["7", "seven"], timeout=60))
    assert results[0] == 7
    assert isinstance(results[1], Failed) and results[1].reason.startswith("ValueError: invalid literal")
    assert asyncio.run(pool.map(abs, [], timeout=1)) == []


def test_a_stuck_item_fails_and_the_pool_recovers(pool: WorkerPool) -> None:
    results = asyncio.run(pool.map(time.sleep, [0, 600], timeout=3))
    assert results[0] is None
    assert results[1] == Failed("not finished within 3 s")
    assert pool.restarts == 1
    assert asyncio.run(pool.map(abs, [-5], timeout=60)) == [5]


def test_a_restart_does_not_fail_other_batches_in_flight(pool: WorkerPool) -> None:
    async def both() -> tuple[list, list]:
        stuck = pool.map(time.sleep, [600], timeout=3)
        other = pool.map(time.sleep, [2.0], timeout=60)
        return await asyncio.gather(stuck, other)

    stuck, other = asyncio.run(both())
    assert isinstance(stuck[0], Failed)
    assert other == [None]  # resubmitted to the new pool if the restart caught it in flight
