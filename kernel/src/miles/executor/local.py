"""`LocalExecutor`: starts the run's processes as children on this machine and supervises them.

One node, ``local`` at 127.0.0.1, with the GPUs this machine shows (``CUDA_VISIBLE_DEVICES`` if
set, else ``nvidia-smi``), or as many as the config says. A process given GPUs sees only those.
Every child gets its own process group and a parent-death signal (:mod:`miles.executor.children`),
so neither Ctrl-C nor a crash of the driver (even SIGKILL) leaves orphans; ``shutdown()``
terminates every group at once, then kills what is still alive. Output goes to
``<run_dir>/logs/<name>.log`` (mode 0600, the run's secrets redacted: :mod:`miles.executor.output`);
a service that dies during start-up is reported with the tail of its log, except one whose port
was taken before it could listen (exit status ``EXIT_ADDRESS_IN_USE``): that one is started again
on another port. So is one whose health check was answered by another program that listens on its
port (another run's server that took it first): a 200 counts only from the service's own process
group (:func:`~miles.executor.children.listener_outside_group`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from miles_contracts.cluster import EXIT_ADDRESS_IN_USE, Endpoint, Node

from miles.errors import MilesError
from miles.executor.children import free_port, listener_outside_group, spawn, terminate_all, terminate_group
from miles.executor.output import OutputPump, open_log
from miles.private_files import private_dir
from miles.redaction import Redactor

HOST = "127.0.0.1"
NODE = "local"
PORT_ATTEMPTS = 5
"""Starts of one service on newly picked ports after its port was taken, before start-up fails."""


class ServiceError(MilesError):
    """A supervised process failed to start or died."""


@dataclass
class Service:
    name: str
    command: Callable[[Endpoint], Sequence[str]]
    endpoint: Endpoint
    health_url: str | None
    env: dict[str, str]
    log_path: Path
    gpus: tuple[str, ...] = ()
    health_path: str | None = None  # set when the executor picked the port (health_url follows it)
    argv: list[str] = field(default_factory=list)  # of the current process
    process: subprocess.Popen[bytes] | None = None
    output: OutputPump | None = None  # copies the current process's output into log_path
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        if self.output is not None and not self.alive():
            self.output.settle()  # what a dead process printed last is what explains it
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalExecutor:
    """Implements :class:`miles_contracts.Executor` with child processes.

    :param gpus: ids of the GPUs the run may use; default: what this machine shows.
    """

    def __init__(self, run_dir: Path, *, startup_timeout: float = 600.0, gpus: Sequence[str] | None = None) -> None:
        self.log_dir = private_dir(run_dir / "logs")
        self.startup_timeout = startup_timeout
        self._given_gpus = tuple(gpus) if gpus is not None else None
        self._services: dict[str, Service] = {}
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None
        self._stop = threading.Event()

    # -------------------------------------------------------------- Executor protocol

    @functools.cached_property
    def _gpus(self) -> tuple[str, ...]:
        """Asked of ``nvidia-smi`` on first use (placement), not by tools that only start servers."""
        return self._given_gpus if self._given_gpus is not None else local_gpus()

    def nodes(self) -> list[Node]:
        return [Node(NODE, HOST, self._gpus)]

    def reserve(self, gpus: int) -> list[Node]:
        if gpus > len(self._gpus):
            raise ServiceError(f"the run needs {gpus} GPUs but this machine has {len(self._gpus)}")
        return [Node(NODE, HOST, self._gpus[:gpus])]

    def driver_address(self) -> str:
        return HOST

    def launch(self, name: str, command: Callable[[Endpoint], Sequence[str]], *, node: str = NODE,
               gpus: Sequence[str] = (), health_path: str | None = None,
               env: Mapping[str, str] | None = None) -> Endpoint:
        if node != NODE:
            raise ServiceError(f"the local executor has one node, {NODE!r}; {name!r} asked for {node!r}")
        if name in self._services and self._services[name].alive():
            raise ServiceError(f"service {name!r} is already running")
        endpoint = Endpoint(HOST, free_port(HOST))
        env = dict(env or {})
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        health_url = f"{endpoint.url}{health_path}" if health_path is not None else None
        service = Service(name, command, endpoint, health_url, env, self.log_dir / f"{name}.log", tuple(gpus),
                          health_path=health_path)
        self._services[name] = service
        self._spawn(service)
        return endpoint

    def wait_healthy(self, name: str) -> None:
        self._wait_healthy(self._services[name])

    def start(self, name: str, argv: Sequence[str], *, health_url: str | None = None,
              env: Mapping[str, str] | None = None) -> None:
        """Start ``argv`` (which picked its own port) and wait for ``health_url``: for tools and
        benchmarks that start a few servers by hand."""
        if name in self._services and self._services[name].alive():
            raise ServiceError(f"service {name!r} is already running")
        fixed = list(argv)
        service = Service(name, lambda _endpoint: fixed, Endpoint(HOST, 0), health_url, dict(env or {}),
                          self.log_dir / f"{name}.log")
        self._services[name] = service
        self._spawn(service)
        self._wait_healthy(service)

    def endpoint(self, name: str) -> Endpoint:
        return self._services[name].endpoint

    def alive(self, name: str) -> bool:
        return self._services[name].alive()

    def returncode(self, name: str) -> int | None:
        process = self._services[name].process
        return process.poll() if process is not None else None

    def restart(self, name: str, *, wait: bool = True) -> Endpoint:
        """Stop ``name`` if it runs, start it again on the same port (and wait until it is healthy);
        on a new port if it ended because its port was taken."""
        service = self._services[name]
        self._terminate(service)
        if service.process is not None and service.process.returncode == EXIT_ADDRESS_IN_USE:
            self._move_to_free_port(service)
        service.restarts += 1
        self._spawn(service)
        if wait:
            self._wait_healthy(service)
        return service.endpoint

    def shutdown(self) -> None:
        self._stop.set()
        services = list(self._services.values())
        terminate_all([s.process for s in services if s.process is not None])
        for service in services:  # the last lines each process printed reach its log
            if service.output is not None:
                service.output.settle()

    def manifest(self) -> list[dict[str, Any]]:
        return [{"name": s.name, "node": NODE, "pid": s.process.pid if s.process else None, "gpus": list(s.gpus),
                 "restarts": s.restarts, "log": str(s.log_path)} for s in self._services.values()]

    # -------------------------------------------------------------- supervision

    def supervise(self, on_death: Callable[[str], None], interval: float = 1.0) -> None:
        """Watch services in a thread; ``on_death(name)`` runs for each one found dead."""

        reported: dict[str, int] = {}  # name -> pid whose death was reported (each death once)

        def watch() -> None:
            while not self._stop.wait(interval):
                for service in list(self._services.values()):
                    process = service.process
                    if process is None or service.alive() or self._stop.is_set():
                        continue
                    if reported.get(service.name) == process.pid:
                        continue
                    reported[service.name] = process.pid
                    try:
                        on_death(service.name)
                    except Exception as exc:  # keep supervising the others
                        print(f"miles: handling the death of {service.name!r} failed: {exc}", file=sys.stderr)

        self._watch = threading.Thread(target=watch, name="miles-supervisor", daemon=True)
        self._watch.start()

    def services(self) -> dict[str, Service]:
        return dict(self._services)

    # -------------------------------------------------------------- internals

    def _spawn(self, service: Service) -> None:
        service.argv = list(service.command(service.endpoint))
        redactor = Redactor.for_environment(os.environ, service.env)
        log = open_log(service.log_path, redactor, service.argv)
        try:
            service.process = spawn(service.argv, log=subprocess.PIPE, env={**os.environ, **service.env})
        except BaseException:
            log.close()
            raise
        assert service.process.stdout is not None
        service.output = OutputPump(service.process.stdout, log, redactor, name=service.name)
        service.started_at = time.monotonic()

    def _move_to_free_port(self, service: Service) -> None:
        """Give ``service`` a newly picked port (its old one was taken by another process)."""
        taken = service.endpoint.port
        service.endpoint = Endpoint(HOST, free_port(HOST))
        if service.health_path is not None:
            service.health_url = f"{service.endpoint.url}{service.health_path}"
        with service.log_path.open("ab") as log:
            log.write(f"==== port {taken} was taken by another process; starting on {service.endpoint.port}\n".encode())

    def _wait_healthy(self, service: Service) -> None:
        if service.health_url is None:
            return
        deadline = time.monotonic() + self.startup_timeout
        moves = 0
        # a proxy named by HTTP_PROXY must never see a loopback health check (nor could it answer one)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not service.alive():
                    code = service.process.returncode if service.process else None
                    if code == EXIT_ADDRESS_IN_USE and service.health_path is not None and moves < PORT_ATTEMPTS:
                        moves += 1
                        self._move_to_free_port(service)
                        self._spawn(service)
                        continue
                    raise ServiceError(
                        f"service {service.name!r} exited with code {code} during start-up; "
                        f"log {service.log_path}:\n{service.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(service.health_url).status_code == 200:
                        if not self._answered_by_another(service) or moves >= PORT_ATTEMPTS:
                            return
                        moves += 1  # another program took the port first: our server cannot listen there
                        self._terminate(service)
                        self._move_to_free_port(service)
                        self._spawn(service)
                        continue
                time.sleep(0.25)
        self._terminate(service)
        raise ServiceError(
            f"service {service.name!r} was not healthy at {service.health_url} after {self.startup_timeout:.0f} s; "
            f"log {service.log_path}:\n{service.log_tail()}"
        )

    @staticmethod
    def _answered_by_another(service: Service) -> bool:
        """The health answer came from a process outside the service's group (each child leads its
        own): another program listens on the port picked for it, e.g. another run's server that
        took it while this one was starting, and it would have been taken for this service."""
        if service.process is None or service.health_path is None or sys.platform != "linux":
            return False  # not started by launch(): its argv holds its port, which cannot be moved
        return listener_outside_group(service.endpoint.port, service.process.pid)

    def _terminate(self, service: Service, grace: float = 5.0) -> None:
        if service.process is not None:
            terminate_group(service.process, grace)
        if service.output is not None:
            service.output.settle()


def local_gpus() -> tuple[str, ...]:
    """GPU ids this machine offers the run: ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi``'s
    list, else none. (No torch here: the kernel stays light, and CUDA must not be initialised in the
    driver before its children pick their devices.)"""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = tuple(v.strip() for v in visible.split(",") if v.strip())
        return () if ids in ((), ("-1",)) else ids
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


__all__ = ["HOST", "NODE", "PORT_ATTEMPTS", "LocalExecutor", "Service", "ServiceError", "free_port", "local_gpus",
           "terminate_group"]
