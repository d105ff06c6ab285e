"""What every Miles server process shares: where its settings come from (``--config``, the flags
derived from its config sections, ``--run-dir``), its security flags, and how it stops on a signal.

A service of a run is started with ``--config <run>/config.yaml`` and the values the launch
decides (host, port, model folder, upstream URLs, ``--run-dir``); every other setting is read from
the config, as trainer ranks read it. :func:`context_from_args` makes the process's
:class:`~miles_contracts.RunContext` from those arguments: the file, the flags given on top of it
(:mod:`miles.cli.section_args`), the kernel for the config's own ``plugins`` section.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_contracts.wire.auth import TOKEN_ENV
from miles_contracts.wire.guard import ALLOWED_HOSTS_ENV, DEFAULT_MAX_BODY_BYTES

from miles.cli.section_args import add_config_file_argument, section_overrides

if TYPE_CHECKING:
    from miles_contracts import RunContext


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--run-dir DIR``: what a run gives each of its services."""
    add_config_file_argument(parser)
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="the run's folder, when the server belongs to a run (a run passes it)")


def context_from_args(args: argparse.Namespace, role: str) -> RunContext:
    """The service context of this process: ``args.config`` loaded with the derived flags given as
    overrides, validated, the kernel loaded for its ``plugins`` section, ``miles_configure``
    called. Raises :class:`~miles.errors.ConfigError` / :class:`~miles.errors.PluginError`."""
    from miles.context import service_context

    run_dir = getattr(args, "run_dir", None)
    return service_context(getattr(args, "config", None), role, section_overrides(args),
                           run_dir=Path(run_dir) if run_dir else None)


def add_server_security_arguments(parser: argparse.ArgumentParser) -> None:
    """``--auth-token``, ``--max-body-mb`` and ``--allowed-host``, the same for the engine, router and
    session server."""
    parser.add_argument("--auth-token", default=None, metavar="TOKEN",
                        help=f"token every route but /health requires (default: ${TOKEN_ENV}; with neither, one is "
                             "made and printed). Prefer the environment variable: flags show in `ps`")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20,
                        help="largest request body in MiB; larger ones are refused with 413 "
                             f"(default {DEFAULT_MAX_BODY_BYTES / 2**20:g})")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help=f"a host name clients may address this server by (repeat for several); IP addresses, "
                             f"localhost and the --host name always work, and {ALLOWED_HOSTS_ENV} lists more")


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The names a server started with ``args`` answers to besides addresses and ``localhost``: its
    ``--host`` and every ``--allowed-host``."""
    return [args.host, *args.allowed_host]


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


def server_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None, *,
                errors: tuple[type[Exception], ...] = ()) -> int:
    """The ``python -m <server>`` entry point every Miles server shares: parse ``argv``, ``run``,
    and turn a :class:`~miles.errors.MilesError` (a bad config, a plugin that cannot load: what the
    executor shows from the log) or one of ``errors`` into ``error: ...`` and exit status 2, Ctrl-C
    into 130."""
    from miles.errors import MilesError

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    reported: tuple[type[Exception], ...] = (MilesError, *errors)
    try:
        return run(args)
    except reported as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
