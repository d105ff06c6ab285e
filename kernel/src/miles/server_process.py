"""What every Miles server process shares: its security flags and how it stops on a signal."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from miles_contracts.wire.auth import TOKEN_ENV
from miles_contracts.wire.guard import DEFAULT_MAX_BODY_BYTES


def add_server_security_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth-token`` and ``--max-body-mb``, the same for the engine, router and session server."""
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help=f"token every route but /health requires (default: ${TOKEN_ENV}; with neither, one is "
                             "made and printed). Prefer the environment variable: flags show in `ps`")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="largest request body in MiB; larger ones are refused with 413 "
                             f"(default {DEFAULT_MAX_BODY_BYTES / 2**20:g})")


def stop_within(grace: float, stop: Callable[[], None]) -> None:
    """On SIGTERM or SIGINT call ``stop()`` and make sure the process is gone ``grace`` seconds later.

    Python runs signal handlers on the main thread between bytecodes, so a main thread inside a
    long C call (a forward pass, a collective waiting for a peer) would not even see the signal.
    The C handler still writes the signal number to the wakeup fd at once: a watcher thread reads
    it, calls ``stop()`` and starts the deadline, after which the process ends with ``os._exit``
    (128 + the signal) if it has not ended by itself. Call from the main thread, before the
    event loops start.
    """
    lock = threading.Lock()
    fired: list[int] = []

    def trigger(signum: int) -> None:
        with lock:
            if fired:
                return
            fired.append(signum)
        threading.Thread(target=_exit_after, args=(grace, 128 + signum), name="miles-exit-deadline", daemon=True).start()
        stop()

    def on_signal(signum: int, frame: object) -> None:
        trigger(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        data = os.read(read_end, 1)
        if data:
            trigger(data[0])

    threading.Thread(target=watch, name="miles-signal-watch", daemon=True).start()


def _exit_after(grace: float, code: int) -> None:
    time.sleep(grace)
    print(f"miles: still running {grace:g} s after the stop signal; exiting now", file=sys.stderr, flush=True)
    os._exit(code)
