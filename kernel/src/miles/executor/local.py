"""`LocalExecutor`: starts the run's services as child processes on this machine and supervises them.

Every child gets its own process group and a parent-death signal (Linux ``PR_SET_PDEATHSIG``), so
neither Ctrl-C nor a crash of the driver (even SIGKILL) leaves orphans; ``shutdown()`` terminates
each group, then kills what is still alive. Output goes to ``<run_dir>/logs/<name>.log``; a service
that dies during start-up is reported with the tail of its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from miles.errors import MilesError

_PR_SET_PDEATHSIG = 1


class ServiceError(MilesError):
    """A supervised process failed to start or died."""


def _die_with_parent() -> None:
    """Runs in the child between fork and exec. Note: the signal fires when the *thread* that
    spawned the child exits, so services are only (re)started from long-lived threads."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Service:
    name: str
    argv: list[str]
    health_url: str | None
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalExecutor:
    """Implements :class:`miles_contracts.Executor` with child processes."""

    def __init__(self, run_dir: Path, *, startup_timeout: float = 600.0) -> None:
        self.log_dir = run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self._services: dict[str, Service] = {}
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()

    # -------------------------------------------------------------- Executor protocol

    def start(self, name: str, argv: Sequence[str], *, health_url: str | None = None,
              env: Mapping[str, str] | None = None) -> None:
        if name in self._services and self._services[name].alive():
            raise ServiceError(f"service {name!r} is already running")
        service = Service(name, list(argv), health_url, dict(env or {}), self.log_dir / f"{name}.log")
        self._services[name] = service
        self._spawn(service)
        self._wait_healthy(service)

    def alive(self, name: str) -> bool:
        return self._services[name].alive()

    def restart(self, name: str) -> None:
        service = self._services[name]
        self._terminate(service)
        service.restarts += 1
        self._spawn(service)
        self._wait_healthy(service)

    def shutdown(self) -> None:
        self._stop.set()
        for service in reversed(list(self._services.values())):
            self._terminate(service)

    # -------------------------------------------------------------- supervision

    def supervise(self, on_death: Callable[[str], None], interval: float = 1.0) -> None:
        """Watch services in a thread; ``on_death(name)`` runs for each one found dead."""

        def watch() -> None:
            while not self._stop.wait(interval):
                for service in list(self._services.values()):
                    if service.process is not None and not service.alive() and not self._stop.is_set():
                        try:
                            on_death(service.name)
                        except Exception as exc:  # keep supervising the others
                            print(f"miles: handling the death of {service.name!r} failed: {exc}", file=sys.stderr)
                            service.process = None  # do not report the same death again

        self._watch = threading.Thread(target=watch, name="miles-supervisor", daemon=True)
        self._watch.start()

    def services(self) -> dict[str, Service]:
        return dict(self._services)

    # -------------------------------------------------------------- internals

    def _spawn(self, service: Service) -> None:
        log = service.log_path.open("ab")
        log.write(f"\n==== start {time.strftime('%H:%M:%S')}: {' '.join(service.argv)}\n".encode())
        log.flush()
        service.process = subprocess.Popen(
            service.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **service.env}, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        service.started_at = time.monotonic()

    def _wait_healthy(self, service: Service) -> None:
        if service.health_url is None:
            return
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not service.alive():
                code = service.process.returncode if service.process else None
                raise ServiceError(
                    f"service {service.name!r} exited with code {code} during start-up; "
                    f"log {service.log_path}:\n{service.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(service.health_url, timeout=2.0).status_code == 200:
                    return
            time.sleep(0.25)
        self._terminate(service)
        raise ServiceError(
            f"service {service.name!r} was not healthy at {service.health_url} after {self.startup_timeout:.0f} s; "
            f"log {service.log_path}:\n{service.log_tail()}"
        )

    def _terminate(self, service: Service, grace: float = 5.0) -> None:
        process = service.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=grace)


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
