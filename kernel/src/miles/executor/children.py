"""Child processes that cannot outlive their parent, and how a group of them is stopped.

Used by the local executor and by Ray's process hosts (``miles_ray.host``).

**Start** (:func:`spawn`). Each child gets its own session (so it and whatever it starts form one
process group to signal) and Linux's parent-death signal (``PR_SET_PDEATHSIG``: SIGTERM when the
parent dies, also by SIGKILL, when no code of the parent runs any more). Two gaps of that signal
are closed here:

* It is tied to the *thread* that forked, not the process: a child started from a thread that
  later ends gets the signal then. So every child of this process is forked by one thread,
  started on first use and alive as long as the process.
* A parent that dies between ``fork`` and ``prctl`` never sends it. The child therefore checks,
  after arming it, that its parent is still the process that forked it, and exits otherwise.

``prctl`` is looked up in the parent, once: between ``fork`` and ``exec`` the child only calls it
(a ``dlopen`` there can deadlock on a lock another thread of the parent held at the fork).

**Stop** (:func:`terminate_all`). SIGTERM to every group at once, one deadline for all of them,
SIGKILL to what is left, then the same for groups whose leader ended but whose members did not.
The driver stopped its services one after another before, each allowed 5 s: an idle run of three
services took 17-22 s to stop.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, Any

_PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGTERM
"""What a child gets when its parent dies: Miles' servers stop within their deadline on it
(``miles.server_process.stop_within``), and a process still importing dies of it at once."""
EXIT_PARENT_GONE = 125
"""Exit status of a child whose parent died before the child could arm the parent-death signal."""


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` arming the parent-death signal in a child of process ``parent``."""
    prctl = _PRCTL

    def arm() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL))
        if os.getppid() != parent:  # the parent died before the signal was armed: it never comes
            os._exit(EXIT_PARENT_GONE)

    return arm


class _Forker:
    """The one thread of this process that starts children (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="miles-child-forker", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return fn()
        done: Future[Any] = Future()
        self._jobs.put((fn, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)


_FORKER = _Forker()


def spawn(argv: Sequence[str], *, log: IO[bytes] | int, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdout and stderr to ``log`` (a file, or ``subprocess.PIPE`` for an
    executor that copies the output itself: :mod:`miles.executor.output`), stdin closed, environment
    ``env``, in a new session, dying with this process (see the module docstring)."""
    parent = os.getpid()

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env), start_new_session=True,
                                preexec_fn=die_with_parent(parent) if _PRCTL is not None else None)

    process: subprocess.Popen[bytes] = _FORKER.call(start)
    return process


def terminate_group(process: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """:func:`terminate_all` for one process."""
    terminate_all([process], grace)


def terminate_all(processes: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM the process groups of ``processes`` (each started in a session of its own), SIGKILL
    those still running ``grace`` seconds later, and reap the processes. What a process started
    stays in its group and is stopped too, also when the process itself already ended (a crashed
    server's workers). Returns within about ``2 * grace`` seconds however many there are."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
    for process in live:
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # unkillable for now (stuck in the kernel): nothing more to do
            print(f"miles: process {process.pid} did not end after SIGKILL", file=sys.stderr)
    _stop_orphans([p.pid for p in processes if p.poll() is not None], grace)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False if it has no process left that we may signal."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_orphans(pgids: Sequence[int], grace: float) -> None:
    """Stop what is left of the groups ``pgids`` once their leaders ended and were reaped. While a
    group has members Linux gives its id to no new process, so a live process of that pid means
    the group is empty and the id someone else's: then nothing is signalled."""
    if not sys.platform.startswith("linux"):
        return
    left = [g for g in pgids if not os.path.exists(f"/proc/{g}") and _signal_group(g, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [g for g in left if _signal_group(g, 0)]
    for pgid in left:
        _signal_group(pgid, signal.SIGKILL)


def listener_outside_group(port: int, group: int) -> bool:
    """Whether the TCP listener on ``port`` belongs to a process outside process group ``group``
    (Linux ``/proc``): a health check there reached another program that took the port, not the
    service. False whenever that cannot be told (no ``/proc``, the listener in another network
    namespace, processes this user cannot read): only an owner positively found outside the group,
    and none inside it, counts."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local_address is HEXIP:HEXPORT, st 0A is LISTEN, the socket's inode is the 10th field
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    outside = False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") not in inodes:
                    continue
                if os.getpgid(int(entry.name)) == group:
                    return False
            except OSError:
                continue
            outside = True
            break
    return outside


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now. Another process may take it before the child
    binds it: a Miles server then exits with ``EXIT_ADDRESS_IN_USE`` and is started again on
    another port, as is any service whose health check another program answered (see
    ``LocalExecutor.wait_healthy`` and :func:`listener_outside_group`)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
