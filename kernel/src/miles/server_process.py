"""What every Miles server process shares: where its settings come from (``--config``, the flags
derived from its config sections, ``--run-dir``), its security flags, and how it stops on a signal.

A service of a run is started with ``--config <run>/config.yaml`` and the values the launch
decides (host, port, model folder, upstream URLs, ``--run-dir``); every other setting is read from
the config, as trainer ranks read it. :func:`context_from_args` makes the process's
:class:`~miles_contracts.RunContext` from those arguments: the file, the flags given on top of it
(:mod:`miles.cli.section_args`), the kernel for the config's own ``plugins`` section.

A server binds its port (:func:`bind_socket`) before its slow start-up, listens when it is about to
serve and says it serves only once it does; it stops within :func:`stop_within`'s deadline
whatever it is doing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from miles_contracts.cluster import EXIT_ADDRESS_IN_USE
from miles_contracts.wire.auth import TOKEN_ENV
from miles_contracts.wire.guard import ALLOWED_HOSTS_ENV, DEFAULT_MAX_BODY_BYTES

from miles.cli.section_args import add_config_file_argument, section_overrides
from miles.errors import MilesError

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


BACKSTOP_S = 1.0
"""Seconds after :func:`stop_within`'s deadline at which faulthandler's C watchdog ends the process
when no Python thread could."""

_received: list[int] = []  # the stop signal this process got (at most one is acted on)


def stop_within(grace: float, stop: Callable[[], None]) -> None:
    """On SIGTERM or SIGINT call ``stop()`` and make sure the process is gone ``grace`` seconds later.

    Python runs signal handlers on the main thread between bytecodes, so a main thread inside a
    long C call (a forward pass, a collective waiting for a peer) would not even see the signal.
    The C handler still writes the signal number to the wakeup fd at once: a watcher thread reads
    it, calls ``stop()`` and starts the deadline, after which the process ends with ``os._exit``
    (128 + the signal) if it has not ended by itself.

    That deadline is a Python thread, and there are states in which no Python thread runs again:
    interpreter finalization (daemon threads are frozen once it starts; an idle engine spent 4-6 s
    garbage-collecting torch's objects there, where this deadline could not fire and the
    executor's SIGKILL came first) or a C call that holds the GIL. So the signal also arms
    faulthandler's watchdog, a C thread that needs no GIL: ``BACKSTOP_S`` after the deadline it
    writes every thread's stack to stderr (what the process was stuck in) and exits with status
    1. And :func:`server_main` ends a process that was told to stop with ``os._exit`` as soon as
    its own shutdown is done, so finalization is never reached. Call from the main thread, before
    the event loops start.
    """
    lock = threading.Lock()

    def trigger(signum: int) -> None:
        with lock:
            if _received:
                return
            _received.append(signum)
        faulthandler.dump_traceback_later(grace + BACKSTOP_S, exit=True, file=sys.__stderr__ or 2)
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


def stop_signal() -> int | None:
    """The signal :func:`stop_within` acted on, or None while none came."""
    return _received[0] if _received else None


def _exit_after(grace: float, code: int) -> None:
    time.sleep(grace)
    print(f"miles: still running {grace:g} s after the stop signal; exiting now", file=sys.stderr, flush=True)
    os._exit(code)


def _end_now(code: int) -> NoReturn:
    """Leave without interpreter finalization: flush what was written, then ``os._exit``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


LISTEN_BACKLOG = 2048  # uvicorn's default


class AddressInUse(MilesError):
    """Another process listens on the address a server was told to listen on."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, not listening yet, for ``uvicorn.Server.run(sockets=[...])``
    once :func:`listen_on` made it listen.

    A server binds before anything slow (the engine before loading its model): a port taken
    meanwhile fails the process in seconds, with :data:`EXIT_ADDRESS_IN_USE` (see
    :func:`server_main`), and the executor starts it again on another port; from then on the port
    is held. Until it listens, connections are refused at once: health probes do not wait out
    their timeouts in a backlog nobody accepts from.

    :raises AddressInUse: the port is taken (the message names the address).
    :raises MilesError: any other reason it cannot bind there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as uvicorn binds: a server restarted on its port must not wait out the old one's TIME_WAITs
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _listen_error(host, port, exc) from None
    return sock


def listen_on(sock: socket.socket) -> None:
    """Start listening on a socket from :func:`bind_socket`. Raises :class:`AddressInUse` when
    another process listens on the port by now (one that binds with ``SO_REUSEADDR`` too, as
    uvicorn does, may bind a port another socket holds but does not listen on yet)."""
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        host, port = sock.getsockname()[:2]
        sock.close()
        raise _listen_error(host, port, exc) from None


def listen_socket(host: str, port: int) -> socket.socket:
    """:func:`bind_socket` and :func:`listen_on` at once, for a server that starts in moments."""
    sock = bind_socket(host, port)
    listen_on(sock)
    return sock


def _listen_error(host: str, port: int, exc: OSError) -> MilesError:
    if exc.errno == errno.EADDRINUSE:
        return AddressInUse(f"cannot listen on {host}:{port}: the address is already in use (another process "
                            "listens there); give a free --port")
    return MilesError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def serve_on_thread(server: Any, sock: socket.socket, *, name: str, timeout: float = 120.0) -> threading.Thread:
    """Run the ``uvicorn.Server`` ``server`` on ``sock`` in a daemon thread; return it once the
    server accepts requests.

    :raises MilesError: the server ended or did not start within ``timeout`` seconds (uvicorn
        logged why).
    """
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise MilesError("the HTTP server stopped during start-up (its error is logged above)")
        if time.monotonic() > deadline:
            raise MilesError(f"the HTTP server did not start within {timeout:g} s")
        thread.join(0.02)
    return thread


def server_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None, *,
                errors: tuple[type[Exception], ...] = ()) -> int:
    """The ``python -m <server>`` entry point every Miles server shares: parse ``argv``, ``run``,
    and turn a :class:`~miles.errors.MilesError` (a bad config, a plugin that cannot load: what the
    executor shows from the log) or one of ``errors`` into ``error: ...`` and exit status 2, a port
    that is taken into :data:`EXIT_ADDRESS_IN_USE`, Ctrl-C into 130. A process that got a stop
    signal (:func:`stop_within`) ends right here with ``os._exit``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    reported: tuple[type[Exception], ...] = (MilesError, *errors)
    try:
        code = run(args)
    except AddressInUse as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_ADDRESS_IN_USE
    except reported as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        if stop_signal() is not None:  # failed while stopping: say how, but do not linger
            traceback.print_exc()
            _end_now(1)
        raise
    return end_if_stopped(code)


def end_if_stopped(code: int) -> int:
    """``code``, or, in a process that got a stop signal (:func:`stop_within`), the end of the
    process with status ``code`` without interpreter finalization (seconds of garbage collection
    in a process that imported torch, beyond the deadline's reach)."""
    if stop_signal() is not None:
        _end_now(code)
    return code
