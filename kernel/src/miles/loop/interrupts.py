"""How ``miles train`` ends when it is told to stop: never with exit code 0.

Ctrl-C (SIGINT) and SIGTERM (what ``kill``, schedulers and container runtimes send) both stop the
run the same way: asyncio cancels the run's main task, the run stops its services and trackers
and reports "run interrupted", and the process exits with 128 + the signal number (130, 143).

Two things made that less than certain before. SIGTERM killed the driver outright (no cleanup,
whatever the services were doing). And a cancellation can be lost inside the run: Python 3.11's
``asyncio.wait_for`` drops a cancel that races with its inner task finishing, and code that
catches ``CancelledError`` loses it too; the run then carried on as if nothing had happened and
could report success. The run therefore also checks its task's ``cancelling()`` count, which a
lost cancellation leaves raised (see :func:`stop_requested`), and this module maps any signal it
saw to a non-zero exit whatever the run returned.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable


def exit_code_of(run: Callable[[], str]) -> int:
    """Run ``run`` (returns the run's status) with SIGTERM handled like Ctrl-C; the exit code:
    0 for ``completed``, 128 + signal after a stop signal, 1 for any other status."""
    received: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        received.append(signum)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            # SIGINT is ignored (a background job of a non-interactive shell, `miles train ... &`), so
            # asyncio.run installed no handler to cancel the run with and a raised SIGINT would be
            # dropped: stop as Python's own Ctrl-C does; asyncio.run then cancels the run's task
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)  # asyncio.run turns SIGINT into a cancellation of the run

    previous_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        status = run()
    except KeyboardInterrupt:
        code = 128 + (received[0] if received else signal.SIGINT)
        print(f"interrupted (exit code {code})", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if received:
        return 128 + received[0]
    return 0 if status == "completed" else 1


def stop_requested() -> bool:
    """Whether the current task was asked to stop (cancelled), even if the cancellation itself
    was swallowed somewhere below it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
