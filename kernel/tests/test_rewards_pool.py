"""WorkerPool: results in order, worker exceptions and missed deadlines become Failed, and a stuck
worker is replaced without failing other batches."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

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


def test_a_restart_under_an_abandoned_batch_is_one_line_not_a_traceback_per_item(
        pool: WorkerPool, capfd: pytest.CaptureFixture[str]) -> None:
    """A batch whose caller gave up (the kernel's own deadline cancelled its ``map``) still has items
    in the pool when another batch's deadline restarts it: they used to print asyncio's "Future
    exception was never retrieved" traceback each (dozens per restart in chaos runs)."""
    import gc

    async def abandon_then_restart() -> list:
        abandoned = asyncio.ensure_future(pool.map(time.sleep, [30, 30, 30], timeout=60))
        await asyncio.sleep(0.5)
        abandoned.cancel()
        return await pool.map(time.sleep, [600], timeout=2)

    stuck = asyncio.run(abandon_then_restart())
    gc.collect()  # the abandoned futures' unretrieved exceptions were reported when collected
    assert isinstance(stuck[0], Failed) and pool.restarts == 1
    err = capfd.readouterr().err
    assert "never retrieved" not in err and "_PoolRestarted" not in err
    assert err.count("the worker pool restarts") == 1


def test_killed_workers_neither_hang_the_pool_nor_the_exit(pool: WorkerPool) -> None:
    """SIGKILL every worker (what ``miles chaos`` does to one): an idle worker holds the task
    queue's read lock, so the items after it are never picked up; they fail at the deadline, the
    restart goes through (it hung in ``Pool.terminate``), the next batch is served, and closing the
    pool (what the driver's exit does) returns."""
    import os
    import signal
    import threading

    assert asyncio.run(pool.map(abs, [-1, -2], timeout=60)) == [1, 2]
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    # fails at the deadline when a killed worker held the lock (the usual case), else is served
    assert asyncio.run(pool.map(abs, [-3], timeout=3)) in ([Failed("not finished within 3 s")], [3])
    assert asyncio.run(pool.map(abs, [-4], timeout=60)) == [4]
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    closing = threading.Thread(target=pool.close, daemon=True)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive()


OWNER_CODE = """
import asyncio, sys
from miles.rewards import WorkerPool
if __name__ == "__main__":
    pool = WorkerPool(processes=2)
    asyncio.run(pool.map(abs, [-1, -2], timeout=60))
    print(*pool.worker_pids(), flush=True)
    sys.stdin.read()
"""


def test_workers_die_with_a_killed_owner(tmp_path: Path) -> None:
    """A driver SIGKILLed (by ``miles chaos``) must not leave its reward workers behind."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(OWNER_CODE)
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    workers = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(workers) == 2
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in workers if _running(pid)]
        time.sleep(0.1)
    assert alive == []


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


EXITING_CODE = """
import asyncio, os, signal, time
from miles.rewards import WorkerPool
if __name__ == "__main__":
    pool = WorkerPool(processes=2)
    asyncio.run(pool.map(abs, [-1, -2], timeout=60))
    time.sleep(0.5)  # idle: one worker waits for a task holding the queue's read lock
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    print("exiting", flush=True)
"""


def test_a_process_whose_workers_were_killed_still_exits(tmp_path: Path) -> None:
    """The driver printed "run completed" and hung in multiprocessing's exit handler when a reward
    worker had been SIGKILLed: the pool must be closed before that handler runs."""
    import subprocess
    import sys

    script = tmp_path / "exiting.py"
    script.write_text(EXITING_CODE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr
