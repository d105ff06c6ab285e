"""Prepare the next bucket while the engines load the current one.

Packing a bucket (a copy into shared memory, or into one CUDA buffer) and an engine loading the
previous one (a copy out of it, in another process) use different cores, so overlapping them brings
a sync close to one memory copy instead of two. At most two prepared buckets exist at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")


def prefetched(items: Iterable[T], prepare: Callable[[T], U],
               release: Callable[[U], None]) -> Generator[tuple[T, U], None, None]:
    """Yield ``(item, prepare(item))`` in order, preparing the next item in a background thread.

    Each prepared value is released when the consumer asks for the next one, or when the
    generator is closed (use ``contextlib.closing`` so an error in the consumer releases too).
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-weights-prepare")
    queue: deque[tuple[T, Future[U]]] = deque()
    try:
        for item in items:
            queue.append((item, pool.submit(prepare, item)))
            if len(queue) > 1:
                yield from _hand_out(queue.popleft(), release)
        while queue:
            yield from _hand_out(queue.popleft(), release)
    finally:
        while queue:
            _, future = queue.popleft()
            with suppress(Exception):
                release(future.result())
        pool.shutdown(wait=True)


def _hand_out(entry: tuple[T, Future[U]], release: Callable[[U], None]) -> Iterator[tuple[T, U]]:
    item, future = entry
    prepared = future.result()
    try:
        yield item, prepared
    finally:
        release(prepared)
