"""``WorkerPool``: CPU-heavy reward checks in worker processes, with a deadline per batch.

Symbolic checks (sympy) must not run on the event loop, and threads would serialise them on the
GIL. A worker stuck in C code cannot be interrupted, so when a batch misses its deadline the pool
is terminated and started again on next use; items of *other* batches that were in flight at that
moment are resubmitted once to the new pool rather than failed.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from miles.executor.children import die_with_parent


@dataclass(frozen=True, slots=True)
class Failed:
    """The outcome of an item that raised or missed the deadline."""

    reason: str


class _PoolRestarted(Exception):
    """The pool was terminated while this item was in flight (another batch timed out)."""


def _start_worker(parent: int, initializer: Callable[[], None] | None) -> None:
    """In each worker, first: die with the pool's process. A driver SIGKILLed (``miles chaos``, the
    OOM killer) left its reward workers behind for good: one waiting on the task queue's lock, which
    a killed sibling held, never saw the queue close. (The signal follows the thread that started
    the worker: the event loop's, or for a replacement the pool's own handler thread, both as
    long-lived as the pool.)"""
    die_with_parent(parent)()
    if initializer is not None:
        initializer()


def _watched(future: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """``future``, its outcome marked as seen whoever waits for it. A ``map`` whose caller was
    cancelled (its scoring missed the kernel's own deadline) leaves its futures behind; the pool
    restart then fails them with :class:`_PoolRestarted`, and asyncio printed a "Future exception
    was never retrieved" traceback for each (dozens per restart in ``miles chaos`` runs). The
    restart is said once, in one line, by the ``map`` that caused it."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return future


class WorkerPool:
    """``await pool.map(fn, items, timeout)`` -> one value or :class:`Failed` per item, in order.

    ``fn`` must be picklable (a module-level function). Processes start lazily with the ``spawn``
    method (safe with threads and event loops in the parent); ``initializer`` runs once in each.
    """

    def __init__(
        self, processes: int | None = None, *, initializer: Callable[[], None] | None = None, start_method: str = "spawn"
    ) -> None:
        self.processes = processes or min(4, os.cpu_count() or 1)
        self._initializer = initializer
        self._context = multiprocessing.get_context(start_method)
        self._lock = threading.Lock()
        self._pool: Any = None
        self._in_flight: set[concurrent.futures.Future[Any]] = set()
        self.restarts = 0

    async def map(self, fn: Callable[[Any], Any], items: Sequence[Any], timeout: float) -> list[Any]:
        results: list[Any] = [None] * len(items)
        todo = list(range(len(items)))
        for _attempt in range(2):
            futures = {i: _watched(asyncio.wrap_future(self._submit(fn, items[i]))) for i in todo}
            if not futures:
                break
            _, late = await asyncio.wait(futures.values(), timeout=timeout)
            if late:
                for future in late:  # nobody will wait for these any more
                    future.cancel()
                self.restarts += 1
                print(f"miles rewards: {len(late)} reward item(s) missed their deadline of {timeout:g} s (a worker "
                      f"died or hangs); they fail with reward_error and the worker pool restarts "
                      f"(restart {self.restarts})", file=sys.stderr, flush=True)
                await asyncio.to_thread(self._restart)
            todo = []
            for i, future in futures.items():
                if future in late:
                    results[i] = Failed(f"not finished within {timeout} s")
                elif isinstance(future.exception(), _PoolRestarted):
                    todo.append(i)
                elif future.exception() is not None:
                    exc = future.exception()
                    results[i] = Failed(f"{type(exc).__name__}: {exc}")
                else:
                    results[i] = future.result()
        for i in todo:
            results[i] = Failed("the worker pool was restarted twice while this item was in flight")
        return results

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes now running (none before the first ``map``)."""
        with self._lock:
            return [w.pid for w in self._pool._pool if w.pid is not None] if self._pool is not None else []

    def close(self) -> None:
        """Stop the worker processes (the pool starts again if used later)."""
        self._restart()

    # ------------------------------------------------------------------ internals

    def _submit(self, fn: Callable[[Any], Any], item: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._pool is None:
                self._pool = self._context.Pool(self.processes, initializer=_start_worker,
                                                initargs=(os.getpid(), self._initializer))
                # closed before multiprocessing's own exit handler, which would hang on a pool whose
                # worker was killed (see _stop): atexit runs the last registered first, and that
                # handler is registered when multiprocessing.util is first imported, which may be
                # after this object was made; registering anew with each pool keeps this one last
                atexit.unregister(self.close)
                atexit.register(self.close)
            self._in_flight.add(future)
            self._pool.apply_async(
                fn, (item,),
                callback=lambda value: self._settle(future, value, None),
                error_callback=lambda exc: self._settle(future, None, exc),
            )
        return future

    def _settle(self, future: concurrent.futures.Future[Any], value: Any, exc: BaseException | None) -> None:
        with self._lock:
            self._in_flight.discard(future)
        if future.done():
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile by its waiter
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)

    def _restart(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            stranded, self._in_flight = self._in_flight, set()
        for future in stranded:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # settled or cancelled meanwhile
                future.set_exception(_PoolRestarted())
        if pool is not None:
            _stop(pool)


def _stop(pool: Any) -> None:
    """``pool.terminate()``, also when a worker was SIGKILLed. ``multiprocessing.Pool`` is not made
    for that: an idle worker waits for its next task holding the task queue's read lock, a worker
    handing back a result holds the result queue's write lock, and one killed meanwhile holds it for
    good; ``terminate`` takes both (CPython's ``_help_stuff_finish`` and its sentinel), so the driver
    hung there at exit after "run completed", and a restart after a deadline hung the same way.
    So: no more replacements (the pool's handler would start new workers, which would take the
    locks), every worker killed, the two locks freed whoever held them (nobody alive can), then
    ``terminate``. (Pool keeps its workers, queues and handler private.)"""
    from multiprocessing.pool import TERMINATE

    pool._worker_handler._state = TERMINATE
    workers = list(pool._pool)
    for worker in workers:
        if worker.exitcode is None:
            worker.kill()
    for worker in workers:
        worker.join(timeout=10)
    for lock in (pool._inqueue._rlock, pool._outqueue._wlock):
        lock.acquire(block=False)  # taken now if it was free: either way it is held, and freed once
        lock.release()
    pool.terminate()
    pool.join()
