"""``miles train``'s SIGTERM stops the run even when SIGINT is ignored, as it is for a background
job of a non-interactive shell (``miles train ... &`` in a script): asyncio then has no SIGINT
handler, and turning SIGTERM into SIGINT alone cancelled nothing (the run went on to "complete")."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

from miles.loop.interrupts import exit_code_of


def test_sigterm_stops_a_run_whose_sigint_is_ignored_and_its_cleanup_runs() -> None:
    cleaned: list[str] = []

    async def run_forever() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cleaned.append("cancelled")
            raise
        finally:
            cleaned.append("services stopped")
        return "completed"

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        code = exit_code_of(lambda: asyncio.run(run_forever()))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # left as the shell set it
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 128 + signal.SIGTERM
    # the run's task was cancelled (not left to sleep out its minute) and its cleanup ran
    assert cleaned == ["cancelled", "services stopped"]
