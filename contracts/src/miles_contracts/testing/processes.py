"""Start a process for a test and wait until it is ready: on what it says, never on a fixed timer.

Integration tests and conformance suites start real processes (an engine, a router, a Ray node,
``miles train``). On a loaded machine (a CI runner, a 2-core box shared by several suites) such a
process can take minutes just to import torch, and a fixed 60 or 120 s timeout then fails a test
whose process was only slow. :func:`wait_ready` polls a readiness signal of the process (``/health``
answering 200, a line of its log, a file it writes) and gives up only when the answer is certain:

- the process exited (the error gives its exit status);
- it stalled: for ``stall_s`` seconds neither it nor any process it started used CPU, and its log
  did not grow. A slow process still gets some CPU; a hung one (a deadlock, a wait on something
  that never comes) gets none;
- the overall deadline passed (``deadline_s``: 8 minutes by default, under pytest-timeout's 10
  minutes a test, so that this message, not a bare timeout, is what the test reports).

The error says what was waited for, how long, why the wait stopped, and ends with the log's tail.

:class:`LoggedProcess` runs a child with its output in a log file -- a pipe that nobody reads blocks a
talkative child once 64 KiB wait in it, which looks exactly like a hang -- in a process group of its
own, so that :meth:`~LoggedProcess.stop` ends whatever it started too. A run that is to succeed (a
``miles train`` a test then reads) is waited for with :meth:`~LoggedProcess.finished`: its exit
status 0 is checked there, and a failure ends with the log's tail.

Usage::

    from miles_contracts.testing.processes import LoggedProcess

    with LoggedProcess([sys.executable, "-m", "my_server", "--port", str(port)], tmp_path / "server.log") as server:
        server.wait_healthy(f"http://127.0.0.1:{port}")
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

DEADLINE_S = 480.0
STALL_S = 120.0
_SAMPLE_S = 2.0  # how often (at most) the process tree's CPU time is read: a walk over /proc
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


class NotReady(AssertionError):
    """What was waited for did not happen. ``reason`` is ``"exited"``, ``"stalled"`` or ``"deadline"``,
    or ``"failed"`` where :meth:`LoggedProcess.finished` saw a run exit with a status other than 0."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def wait_ready(ready: Callable[[], bool], what: str, *, process: subprocess.Popen[Any] | None = None,
               log: Path | None = None, alive: Callable[[], bool] | None = None,
               deadline_s: float = DEADLINE_S, stall_s: float = STALL_S, interval_s: float = 0.2) -> float:
    """Poll ``ready()`` until it returns True; returns the seconds waited.

    :param what: what is waited for, as the error should name it ("engine-0 answering /health").
    :param process: the process that should get there: its exit ends the wait, and while it and its
        descendants use no CPU (and ``log`` does not grow) for ``stall_s`` seconds it counts as hung.
    :param log: its output, whose growth counts as progress and whose tail ends every error.
    :param alive: for what is not a child process (a server on a thread of this process): False
        once it has ended.
    :raises NotReady: see the module docstring.
    """
    started = time.monotonic()
    progress = _Progress(process.pid if process is not None else None, log, sample_s=min(_SAMPLE_S, stall_s / 4))
    while True:
        if ready():
            return time.monotonic() - started
        ended = _ended(process, alive)
        if ended is not None:
            if ready():  # it got there, then exited on purpose
                return time.monotonic() - started
            raise _not_ready(what, started, ended, log, "exited")
        now = time.monotonic()
        idle = progress.idle_for(now)
        if idle > stall_s:
            signs = [*(["the process and its children used no CPU"] if process is not None else []),
                     *(["its log did not grow"] if log is not None else [])]
            raise _not_ready(what, started, f"no progress for {idle:.0f} s: {' and '.join(signs)}", log, "stalled")
        if now - started > deadline_s:
            last = f" (its last sign of progress: {idle:.0f} s before)" if progress.watching else ""
            raise _not_ready(what, started, f"the deadline of {deadline_s:.0f} s passed{last}", log, "deadline")
        time.sleep(interval_s)


def http_ok(url: str, timeout_s: float = 10.0) -> Callable[[], bool]:
    """A readiness check: ``GET url`` answers 200. A busy server may take seconds to answer, hence
    the generous ``timeout_s`` for one request."""

    def check() -> bool:
        try:
            with _HTTP.open(url, timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (OSError, http.client.HTTPException):  # not listening yet, or cut off mid-answer
            return False

    return check


def log_says(log: Path, text: str) -> Callable[[], bool]:
    """A readiness check: ``text`` (a line the process prints once it is ready) is in ``log``."""
    needle = text.encode()
    return lambda: log.exists() and needle in log.read_bytes()


def log_tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def tree_cpu_ticks(pid: int) -> int:
    """CPU time (clock ticks, user + system) of process ``pid`` and every process below it, including
    children they have reaped; 0 where ``/proc`` cannot be read."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, ticks)
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += stats.get(current, (0, 0))[1]
        todo.extend(children.get(current, ()))
    return total


class _Progress:
    """When the watched process tree last used CPU or its log last grew."""

    def __init__(self, pid: int | None, log: Path | None, *, sample_s: float) -> None:
        self.pid, self.log, self.sample_s = pid, log, sample_s
        self.last_sample = self.last_change = time.monotonic()
        self.seen = self._state()

    def _state(self) -> tuple[int, int]:
        ticks = tree_cpu_ticks(self.pid) if self.pid is not None else 0
        try:
            size = self.log.stat().st_size if self.log is not None else 0
        except OSError:
            size = 0
        return ticks, size

    @property
    def watching(self) -> bool:
        return self.pid is not None or self.log is not None

    def idle_for(self, now: float) -> float:
        """Seconds since the last sign of progress (0 when there is nothing to watch)."""
        if not self.watching:
            return 0.0
        if now - self.last_sample >= self.sample_s:
            self.last_sample = now
            state = self._state()
            if state != self.seen:
                self.seen, self.last_change = state, now
        return now - self.last_change


def _ended(process: subprocess.Popen[Any] | None, alive: Callable[[], bool] | None) -> str | None:
    if process is not None and (code := process.poll()) is not None:
        return f"the process exited with {_status(code)}"
    if alive is not None and not alive():
        return "it ended"
    return None


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def _not_ready(what: str, started: float, why: str, log: Path | None, reason: str) -> NotReady:
    message = f"{what}: gave up after {time.monotonic() - started:.0f} s: {why}"
    if log is not None:
        message += f"\n--- the end of {log} ---\n{log_tail(log)}"
    return NotReady(message, reason)


_LIVE: set[LoggedProcess] = set()


@atexit.register
def _kill_leftovers() -> None:  # the last resort when a finalizer never ran (an interrupted session)
    for process in list(_LIVE):
        process.kill()


class LoggedProcess:
    """A child started from ``argv`` with stdout and stderr in ``log_path`` (appended to: a restart
    keeps the first start's lines), in a process group of its own. Stopped for sure by :meth:`stop`
    (SIGTERM, then SIGKILL): call it in a ``finally`` or use the object as a context manager.

    :param env: variables set on top of this process's environment.
    :param default_signals: signals the child gets back at their default action. A suite started in
        the background (``cmd &`` without job control) runs with SIGINT ignored, which its children
        inherit; a test that sends Ctrl-C names SIGINT here.
    :param stdout_path: stdout into a file of its own (a command's report), ``log_path`` keeping stderr.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None, default_signals: Sequence[signal.Signals] = (),
                 stdout_path: Path | None = None) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.stdout_path = Path(stdout_path) if stdout_path is not None else None
        self.env = dict(env or {})
        self.cwd = cwd
        self.default_signals = tuple(default_signals)
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> LoggedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        restore = self.default_signals

        def in_child() -> None:  # between fork and exec
            for sig in restore:
                signal.signal(sig, signal.SIG_DFL)

        with contextlib.ExitStack() as files:
            stdout = files.enter_context(self.stdout_path.open("ab")) if self.stdout_path else self._log
            self.process = subprocess.Popen(self.argv, stdout=stdout, stderr=self._log if self.stdout_path
                                            else subprocess.STDOUT, cwd=self.cwd, env={**os.environ, **self.env},
                                            start_new_session=True, preexec_fn=in_child if restore else None)
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def returncode(self) -> int | None:
        return self._started().poll()

    def wait_ready(self, ready: Callable[[], bool], what: str, *, deadline_s: float = DEADLINE_S,
                   stall_s: float = STALL_S) -> float:
        """:func:`wait_ready` on this process and its log."""
        return wait_ready(ready, what, process=self._started(), log=self.log_path, deadline_s=deadline_s,
                          stall_s=stall_s)

    def wait_healthy(self, url: str, *, path: str = "/health", deadline_s: float = DEADLINE_S,
                     stall_s: float = STALL_S) -> float:
        """Until ``GET url + path`` answers 200."""
        return self.wait_ready(http_ok(url + path), f"`{self._name()}` answering {url}{path}",
                               deadline_s=deadline_s, stall_s=stall_s)

    def wait_exit(self, what: str | None = None, *, deadline_s: float = DEADLINE_S,
                  stall_s: float = STALL_S) -> int:
        """Until the process has exited (a run that finishes); returns its exit status. A run that
        hangs (no CPU, no output) or outlives the deadline raises :class:`NotReady`."""
        process = self._started()
        self.wait_ready(lambda: process.poll() is not None, what or f"`{self._name()}` to finish",
                        deadline_s=deadline_s, stall_s=stall_s)
        return process.returncode

    def finished(self, what: str | None = None, *, deadline_s: float = DEADLINE_S, stall_s: float = STALL_S) -> str:
        """Until the process has exited, which must be with status 0 (a run that is to succeed);
        everything it wrote. Another status raises :class:`NotReady` (reason ``"failed"``) with the
        status and the log's tail; a hang or the deadline as in :meth:`wait_exit`."""
        what = what or f"`{self._name()}` to finish"
        code = self.wait_exit(what, deadline_s=deadline_s, stall_s=stall_s)
        if code != 0:
            raise NotReady(f"{what}: it exited with {_status(code)}\n--- the end of {self.log_path} ---\n"
                           f"{log_tail(self.log_path, 80)}", "failed")
        return self.output()

    def output(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process alone (as Ctrl-C reaches a program), not to its group."""
        self._started().send_signal(sig)

    def kill(self) -> None:
        """SIGKILL to the whole process group: it dies with whatever it was doing."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        _LIVE.discard(self)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the group, SIGKILL after ``grace_s``; the group is killed either way, so nothing
        the process started outlives it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        self.kill()
        if self._log is not None:
            self._log.close()

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError(f"`{self._name()}` was not started: call start() first")
        return self.process

    def _name(self) -> str:
        return " ".join(self.argv[:4]) + (" ..." if len(self.argv) > 4 else "")

    def __enter__(self) -> LoggedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
