"""Conformance suite for executors: ``check_executor(make_executor, run_dir)``.

An executor (see :class:`miles_contracts.Executor`) is checked with real child processes on this
machine: each is a small HTTP server written here with the standard library (:data:`SERVER`), which
answers ``GET /health`` with its pid, port and environment, prints a line to stdout and one to stderr
when it starts, and can be told to hold its health at 503 until a gate file appears, to start a helper
process of its own (a grandchild of the executor, in its process group), or to exit at once with
status 3; one whose port is taken exits with status 98 (``EXIT_ADDRESS_IN_USE``), as Miles'
servers do. No GPU is used (``gpus=()``). What is checked, one function each in :data:`EXECUTOR_CHECKS`:

- ``nodes``: ``nodes()`` lists :class:`Node` s with unique names; ``reserve(0)`` is the driver's node
  alone, without GPUs, one of ``nodes()``, at ``driver_address()``.
- ``launch``: ``launch`` returns an :class:`Endpoint` at once (while the process is not healthy yet),
  having called ``command(endpoint)`` exactly once with that endpoint; ``endpoint(name)`` agrees;
  ``wait_healthy`` blocks until the health path answers 200; ``env`` reaches the child; ``alive`` is
  True and ``returncode`` None while it runs.
- ``logs``: the process's stdout and stderr reach ``<run>/logs/<name>.log``.
- ``no_health_path``: without a health path ``wait_healthy`` returns (a no-op).
- ``start_failure``: a process that exits before it is healthy makes ``wait_healthy`` raise, with
  the tail of its log in the message; then ``alive`` is False and ``returncode`` its exit status.
- ``port_taken``: a process whose port another process took before it listened (it exits with
  ``EXIT_ADDRESS_IN_USE``, 98) is started again on another port; ``wait_healthy`` returns, and
  ``endpoint(name)`` and the command's last call give the new port.
- ``kill``: after SIGKILL, ``alive`` turns False and ``returncode`` is ``-SIGKILL``.
- ``restart``: a dead process comes back healthy (same or new endpoint, the one ``endpoint(name)``
  then gives), ``command`` called again with it, a new pid, its ``env``, both starts in its log.
- ``restart_live``: ``restart(wait=False)`` of a live process replaces it (the old pid ends);
  ``wait_healthy`` then waits for the new one.
- ``supervise``: ``on_death(name)`` is called from a thread other than the caller's, once for a
  death, and once more for a second death after a restart.
- ``unique_names``: launching a name whose process is running is refused (process names are unique
  in a run), and the running process is left alone.
- ``manifest``: one JSON-ready row per process with ``name``, ``node``, ``pid`` (the live process's
  own), ``gpus``, ``restarts`` (as many as the suite made) and ``log`` (``<run>/logs/<name>.log``).

:func:`check_executor` runs the checks on one executor, each with processes of its own names. With
``supervise`` selected it calls ``supervise`` before the first check and, after the last, checks that
every death any check caused was reported exactly once (a restart may hide or add one, and is
allowed for) and that no process was reported dead that never ended (one being launched or
restarted). It always ends with ``shutdown`` and checks that it leaves no process behind: every pid
the suite saw, servers and their helpers (whose server may have died long before), is gone. Waits
have generous timeouts; nothing asserts how fast an executor is.

Usage::

    from miles_contracts.testing.executor import check_executor

    def test_my_executor_conforms(tmp_path):
        check_executor(lambda run_dir: MyExecutor(run_dir), tmp_path / "run")
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from miles_contracts.cluster import Endpoint, Node
from miles_contracts.protocols import Executor

HEALTH = "/health"
ENV_NAME = "EXECUTOR_CHECK_VALUE"  # not MILES_*: an executor may forward those on its own
MANIFEST_KEYS = ("name", "node", "pid", "gpus", "restarts", "log")

# The child, written to <run>/executor_check_server.py and started as ``python that-file token name
# host port mode gate``. ``mode``: ``serve``; ``helper`` (also starts a sleeping grandchild in its
# process group); ``fail`` (prints why and exits 3 before serving). ``gate``: a file that must exist
# before /health answers 200 (``-``: none). ``token`` only marks the process as the suite's.
SERVER = r"""
import errno, json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

token, name, host, port, mode, gate = sys.argv[1:7]
print(f"executor-check {name}: started pid={os.getpid()} port={port}", flush=True)
print(f"executor-check {name}: stderr of pid={os.getpid()}", file=sys.stderr, flush=True)
if mode == "fail":
    print(f"executor-check {name}: refusing to start (status 3), as the suite asked", flush=True)
    sys.exit(3)
helper = None
if mode == "helper":
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", token])


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/health":
            self.send_error(404)
            return
        if gate != "-" and not os.path.exists(gate):
            self.send_error(503)
            return
        body = json.dumps({"name": name, "pid": os.getpid(), "port": int(port),
                           "env": os.environ.get("EXECUTOR_CHECK_VALUE"),
                           "helper": helper.pid if helper else None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


try:
    server = ThreadingHTTPServer((host, int(port)), Health)
except OSError as exc:
    if exc.errno != errno.EADDRINUSE:
        raise
    print(f"executor-check {name}: port {port} is taken (status 98)", flush=True)
    sys.exit(98)
server.serve_forever()
"""

# health checks must reach 127.0.0.1 directly, whatever proxy the environment names
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ExecutorUnderTest:
    """One executor and what the suite learned while checking it (shared by the checks).

    :ivar executor: the executor under test.
    :ivar run_dir: the run folder it was made for.
    :ivar node: where the suite starts its processes (``reserve(0)``: the driver's node).
    :ivar token: in the argv of every process the suite starts, to tell them from any other.
    :ivar timeout: seconds any single wait may take.
    """

    def __init__(self, executor: Executor, run_dir: Path, *, timeout: float) -> None:
        self.executor = executor
        self.run_dir = run_dir
        self.timeout = timeout
        self.token = f"executor-check-{uuid.uuid4().hex[:12]}"
        self.server = run_dir / "executor_check_server.py"
        self.server.write_text(SERVER)
        self.node = ""
        self.launched: list[str] = []  # names, in the order first launched
        self.calls: dict[str, list[Endpoint]] = {}  # name -> endpoints its command was called with
        self.restarts: Counter[str] = Counter()
        self.pids: dict[int, str] = {}  # every server and helper pid seen -> what it is
        self.died: Counter[str] = Counter()  # deaths the suite caused and must see reported
        self.ended: set[str] = set()  # names whose process the suite made end at least once
        self.may_report: Counter[str] = Counter()  # reports a restart may add (or hide)
        self.uncounted: set[str] = set()  # names of checks that failed: their reports prove nothing
        self.reports: list[tuple[str, bool]] = []  # (name, from the caller's thread) per on_death
        self.spurious: list[str] = []  # on_death for a process that never ended
        self._reported = threading.Condition()
        self._caller = threading.current_thread()

    # ------------------------------------------------------------------ processes

    def command(self, name: str, mode: str = "serve", gate: Path | None = None) -> Callable[[Endpoint], list[str]]:
        calls = self.calls.setdefault(name, [])

        def command(endpoint: Endpoint) -> list[str]:
            calls.append(endpoint)
            return [sys.executable, str(self.server), self.token, name, endpoint.host, str(endpoint.port), mode,
                    str(gate) if gate is not None else "-"]

        return command

    def env(self, name: str) -> dict[str, str]:
        return {ENV_NAME: f"{self.token}:{name}"}

    def launch(self, name: str, mode: str = "serve", *, gate: Path | None = None,
               health_path: str | None = HEALTH) -> Endpoint:
        if name not in self.launched:
            self.launched.append(name)
        endpoint = self.executor.launch(name, self.command(name, mode, gate), node=self.node, gpus=(),
                                        health_path=health_path, env=self.env(name))
        _expect(isinstance(endpoint, Endpoint) and isinstance(endpoint.port, int) and endpoint.port > 0,
                f"launch({name!r}) returned {endpoint!r}; expected an Endpoint with a port")
        return endpoint

    def healthy(self, name: str) -> dict[str, Any]:
        """What the process at ``endpoint(name)`` answers on /health, which it must (it was reported
        healthy); its pid and its helper's are remembered for the shutdown check."""
        endpoint = self.executor.endpoint(name)
        status, answer = get(endpoint.url + HEALTH)
        _expect(status == 200 and isinstance(answer, dict) and answer.get("name") == name,
                f"{name!r} was reported healthy, but GET {endpoint.url}{HEALTH} answered {status} {answer!r}")
        self.pids[int(answer["pid"])] = f"process {name!r}"
        if answer.get("helper"):
            self.pids[int(answer["helper"])] = f"a helper process started by {name!r}"
        return dict(answer)

    def kill(self, name: str, pid: int, *, reported: bool = True) -> None:
        """SIGKILL the process (not its group) and wait until the executor sees it dead.

        :param reported: whether ``on_death`` must report this death (False: it may, as when the
            suite restarts the process before a watcher could have seen it dead)."""
        self.ended.add(name)
        os.kill(pid, signal.SIGKILL)
        if reported:
            self.died[name] += 1
        else:
            self.may_report[name] += 1
        eventually(lambda: not self.executor.alive(name), self.timeout,
                   f"alive({name!r}) is still True {self.timeout:.0f} s after its process {pid} was killed")

    def running(self, pid: int) -> bool:
        return running(pid, self.token)

    # ------------------------------------------------------------------ supervision

    def on_death(self, name: str) -> None:
        with self._reported:
            self.reports.append((name, threading.current_thread() is self._caller))
            if name not in self.ended:
                self.spurious.append(name)
            self._reported.notify_all()

    def reported(self, name: str) -> int:
        with self._reported:
            return sum(1 for n, _ in self.reports if n == name)

    def wait_reported(self, name: str, count: int) -> None:
        deadline = time.monotonic() + self.timeout
        with self._reported:
            while sum(1 for n, _ in self.reports if n == name) < count:
                left = deadline - time.monotonic()
                _expect(left > 0, f"supervise: on_death({name!r}) was called {self.reported(name)} time(s) within "
                                  f"{self.timeout:.0f} s, expected {count} (the suite ended its process "
                                  f"{self.died[name]} time(s))")
                self._reported.wait(min(left, 0.5))

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"


Check = Callable[[ExecutorUnderTest], None]
EXECUTOR_CHECKS: dict[str, Check] = {}


def _check(fn: Check) -> Check:
    EXECUTOR_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


# ---------------------------------------------------------------------------- helpers


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def get(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """``GET url``: its status and JSON (``(0, None)`` when nothing answers)."""
    try:
        with _HTTP.open(url, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def eventually(condition: Callable[[], bool], timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        _expect(time.monotonic() < deadline, message)
        time.sleep(0.05)


def running(pid: int, token: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process with ``token`` in its argv."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return token.encode() in cmdline and state not in ("Z", "X")


def _log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------- checks


@_check
def check_nodes(t: ExecutorUnderTest) -> None:
    nodes = t.executor.nodes()
    _expect(isinstance(nodes, list) and bool(nodes) and all(isinstance(n, Node) for n in nodes),
            f"nodes() returned {nodes!r}; expected a non-empty list of Node")
    names = [n.name for n in nodes]
    _expect(len(set(names)) == len(names), f"nodes() names a node twice: {names}")
    for node in nodes:
        _expect(isinstance(node.address, str) and bool(node.address) and isinstance(node.gpus, tuple)
                and all(isinstance(g, str) for g in node.gpus),
                f"nodes() gives {node!r}; a node needs an address and a tuple of GPU id strings")
    driver = t.executor.driver_address()
    _expect(isinstance(driver, str) and bool(driver), f"driver_address() returned {driver!r}")
    reserved = t.executor.reserve(0)
    _expect(isinstance(reserved, list) and len(reserved) == 1 and isinstance(reserved[0], Node),
            f"reserve(0) returned {reserved!r}; expected the driver's node alone")
    home = reserved[0]
    _expect(home.gpus == (), f"reserve(0) gives {home!r}; with 0 GPUs the node comes without GPUs")
    _expect(home.name in names, f"reserve(0) gives node {home.name!r}, which nodes() does not list ({names})")
    _expect(home.address == driver, f"reserve(0) gives node address {home.address!r} but driver_address() "
                                    f"is {driver!r}; the driver's node is at the driver's address")


@_check
def check_launch(t: ExecutorUnderTest) -> None:
    name = "launch-0"
    gate = t.run_dir / f"{t.token}-{name}.gate"
    # The gate keeps the process unhealthy. Were launch to wait for health, it would return only
    # after this timer opened the gate: then it did not return "at once".
    late = threading.Timer(t.timeout, gate.touch)
    late.daemon = True
    late.start()
    try:
        endpoint = t.launch(name, gate=gate)
    finally:
        late.cancel()
    _expect(not gate.exists(), f"launch({name!r}) returned only once the process was healthy; it must return at "
                               "once with the endpoint (wait_healthy is for waiting)")
    _expect(t.calls[name] == [endpoint], f"launch({name!r}) returned {endpoint!r} but called command with "
                                         f"{t.calls[name]!r}; expected one call, with the returned endpoint")
    _expect(t.executor.endpoint(name) == endpoint,
            f"endpoint({name!r}) is {t.executor.endpoint(name)!r}, launch returned {endpoint!r}")
    eventually(lambda: get(endpoint.url + HEALTH)[0] == 503, t.timeout,
               f"{name!r} never answered at {endpoint.url}{HEALTH}: did the process get the endpoint's port?")
    _expect(t.executor.alive(name) and t.executor.returncode(name) is None,
            f"while {name!r} runs, alive() is {t.executor.alive(name)} and returncode() "
            f"{t.executor.returncode(name)!r}; expected True and None")
    opened = threading.Timer(0.3, gate.touch)
    opened.start()
    try:
        t.executor.wait_healthy(name)
        _expect(gate.exists(), f"wait_healthy({name!r}) returned while {HEALTH} still answered 503")
    finally:
        opened.cancel()
        opened.join()
    answer = t.healthy(name)
    _expect(answer["port"] == endpoint.port, f"{name!r} listens on {answer['port']}, its endpoint is {endpoint!r}")
    _expect(answer["env"] == t.env(name)[ENV_NAME],
            f"env did not reach {name!r}: it sees {ENV_NAME}={answer['env']!r}, launch gave {t.env(name)[ENV_NAME]!r}")


@_check
def check_logs(t: ExecutorUnderTest) -> None:
    name = "logs-0"
    t.launch(name)
    t.executor.wait_healthy(name)
    pid = t.healthy(name)["pid"]
    wanted = [f"executor-check {name}: started pid={pid}", f"executor-check {name}: stderr of pid={pid}"]
    path = t.log(name)
    eventually(lambda: all(w in _log_text(path) for w in wanted), t.timeout,
               f"{path} lacks {[w for w in wanted if w not in _log_text(path)]} (stdout and stderr of {name!r}) "
               f"after {t.timeout:.0f} s; it holds:\n{_log_text(path)[-2000:]}")


@_check
def check_no_health_path(t: ExecutorUnderTest) -> None:
    name = "nohealth-0"
    t.launch(name, health_path=None)
    t.executor.wait_healthy(name)  # a no-op; a hang here is the failure


@_check
def check_start_failure(t: ExecutorUnderTest) -> None:
    name = "broken-0"
    t.ended.add(name)
    t.launch(name, mode="fail")
    try:
        t.executor.wait_healthy(name)
    except Exception as exc:
        message = str(exc)
    else:
        raise AssertionError(f"wait_healthy({name!r}) returned although the process exited before it was healthy")
    t.died[name] += 1
    _expect("refusing to start (status 3)" in message,
            f"wait_healthy({name!r}) raised without the tail of the log; its message: {message[:1500]!r}")
    eventually(lambda: t.executor.returncode(name) is not None, t.timeout,
               f"returncode({name!r}) is still None after wait_healthy said it exited")
    _expect(not t.executor.alive(name) and t.executor.returncode(name) == 3,
            f"after {name!r} exited with status 3, alive() is {t.executor.alive(name)} and returncode() "
            f"{t.executor.returncode(name)!r}")


@_check
def check_port_taken(t: ExecutorUnderTest) -> None:
    name = "port-taken-0"
    command = t.command(name)
    squatter = socket.socket()  # the process that takes the port between the executor's choice and the bind

    def taken_first(endpoint: Endpoint) -> list[str]:
        if not t.calls.get(name):
            squatter.bind((endpoint.host, endpoint.port))
            squatter.listen()
        return command(endpoint)

    t.launched.append(name)
    t.ended.add(name)  # its first process ends (status 98): a watcher may report it
    t.may_report[name] += 1
    try:
        first = t.executor.launch(name, taken_first, node=t.node, gpus=(), health_path=HEALTH, env=t.env(name))
        t.executor.wait_healthy(name)
        moved = t.executor.endpoint(name)
        _expect(moved.port != first.port,
                f"{name!r}: its port {first.port} was taken, yet endpoint() still names it after wait_healthy")
        _expect(len(t.calls[name]) >= 2 and t.calls[name][-1] == moved,
                f"{name!r}: command must be called again with the new endpoint {moved!r}; calls: {t.calls[name]!r}")
        t.healthy(name)
    finally:
        squatter.close()


@_check
def check_kill(t: ExecutorUnderTest) -> None:
    name = "kill-0"
    t.launch(name, mode="helper")  # its helper outlives it: shutdown must still stop that
    t.executor.wait_healthy(name)
    t.kill(name, t.healthy(name)["pid"])
    code = t.executor.returncode(name)
    _expect(code == -signal.SIGKILL, f"returncode({name!r}) is {code!r} after SIGKILL; expected {-signal.SIGKILL}")


@_check
def check_restart(t: ExecutorUnderTest) -> None:
    name = "restart-0"
    t.launch(name)
    t.executor.wait_healthy(name)
    first = t.healthy(name)["pid"]
    t.kill(name, first, reported=False)  # the restart may come before a watcher saw the death
    endpoint = t.executor.restart(name)
    t.restarts[name] += 1
    _expect(isinstance(endpoint, Endpoint), f"restart({name!r}) returned {endpoint!r}; expected an Endpoint")
    _expect(t.executor.endpoint(name) == endpoint,
            f"after restart({name!r}) returned {endpoint!r}, endpoint() gives {t.executor.endpoint(name)!r}")
    _expect(len(t.calls[name]) == 2 and t.calls[name][-1] == endpoint,
            f"restart({name!r}) must call command again with the endpoint it returns ({endpoint!r}); "
            f"command was called with {t.calls[name]!r}")
    _expect(t.executor.alive(name) and t.executor.returncode(name) is None,
            f"after restart({name!r}), alive() is {t.executor.alive(name)} and returncode() "
            f"{t.executor.returncode(name)!r}")
    answer = t.healthy(name)  # restart waited until it is healthy
    _expect(answer["pid"] != first, f"restart({name!r}) left pid {first}; expected a new process")
    _expect(answer["env"] == t.env(name)[ENV_NAME], f"env did not reach {name!r} after its restart: {answer['env']!r}")
    path = t.log(name)
    wanted = [f"executor-check {name}: started pid={pid}" for pid in (first, answer["pid"])]
    eventually(lambda: all(w in _log_text(path) for w in wanted), t.timeout,
               f"{path} should hold the output of both starts of {name!r} ({wanted}); it holds:\n"
               f"{_log_text(path)[-2000:]}")


@_check
def check_restart_live(t: ExecutorUnderTest) -> None:
    name = "relive-0"
    t.launch(name)
    t.executor.wait_healthy(name)
    first = t.healthy(name)["pid"]
    t.may_report[name] += 1  # the old process's end may be reported
    t.ended.add(name)
    endpoint = t.executor.restart(name, wait=False)
    t.restarts[name] += 1
    _expect(isinstance(endpoint, Endpoint) and t.executor.endpoint(name) == endpoint,
            f"restart({name!r}, wait=False) returned {endpoint!r}, endpoint() gives {t.executor.endpoint(name)!r}")
    t.executor.wait_healthy(name)
    answer = t.healthy(name)
    _expect(answer["pid"] != first, f"restart({name!r}) of a live process kept pid {first}; expected a new one")
    eventually(lambda: not t.running(first), t.timeout,
               f"restart({name!r}) left its old process {first} running next to the new one {answer['pid']}")


@_check
def check_supervise(t: ExecutorUnderTest) -> None:
    name = "watched-0"
    t.launch(name)
    t.executor.wait_healthy(name)
    t.kill(name, t.healthy(name)["pid"])
    t.wait_reported(name, 1)
    t.executor.restart(name)
    t.restarts[name] += 1
    t.kill(name, t.healthy(name)["pid"])
    t.wait_reported(name, 2)
    callers = [n for n, from_caller in t.reports if from_caller]
    _expect(not callers, f"on_death was called from the thread that called supervise (for {callers}); "
                         "it must be called from a watcher thread")


@_check
def check_unique_names(t: ExecutorUnderTest) -> None:
    name = "unique-0"
    endpoint = t.launch(name)
    t.executor.wait_healthy(name)
    pid = t.healthy(name)["pid"]
    try:
        t.executor.launch(name, t.command(name), node=t.node, gpus=(), health_path=HEALTH, env=t.env(name))
    except Exception:
        pass
    else:
        raise AssertionError(f"a second launch({name!r}) while {name!r} runs was accepted; process names are "
                             "unique in a run, so it must be refused")
    _expect(t.running(pid) and t.executor.alive(name) and t.executor.endpoint(name) == endpoint,
            f"the refused second launch({name!r}) disturbed the running one (pid {pid} running: {t.running(pid)}, "
            f"endpoint {t.executor.endpoint(name)!r}, was {endpoint!r})")


@_check
def check_manifest(t: ExecutorUnderTest) -> None:
    if not t.launched:  # alone: give it something to list
        t.launch("manifest-0")
        t.executor.wait_healthy("manifest-0")
    rows = t.executor.manifest()
    _expect(isinstance(rows, list) and all(isinstance(r, dict) for r in rows),
            f"manifest() returned {rows!r:.500}; expected a list of dicts")
    try:
        json.dumps(rows)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"manifest() is not JSON-ready (it becomes services.json): {exc}") from None
    names = [str(r.get("name")) for r in rows]
    _expect(sorted(names) == sorted(t.launched),
            f"manifest() has rows for {sorted(names)}; the suite launched {sorted(t.launched)} (one row each)")
    for row in rows:
        name = row["name"]
        missing = [k for k in MANIFEST_KEYS if k not in row]
        _expect(not missing, f"manifest() row of {name!r} lacks {missing}: {row!r}")
        _expect(row["node"] == t.node, f"manifest() puts {name!r} on {row['node']!r}; it was launched on {t.node!r}")
        _expect(isinstance(row["gpus"], list | tuple) and list(row["gpus"]) == [],
                f"manifest() gives {name!r} gpus {row['gpus']!r}; it was launched with none")
        _expect(row["restarts"] == t.restarts[name],
                f"manifest() counts {row['restarts']!r} restarts of {name!r}; the suite restarted it {t.restarts[name]} time(s)")
        _expect(Path(row["log"]).resolve() == t.log(name).resolve(),
                f"manifest() gives {name!r} the log {row['log']!r}; expected {t.log(name)}")
        if t.executor.alive(name):
            status, answer = get(t.executor.endpoint(name).url + HEALTH)
            if status == 200:
                _expect(row["pid"] == answer["pid"],
                        f"manifest() gives {name!r} pid {row['pid']!r}; the process says it is {answer['pid']}")


# ---------------------------------------------------------------------------- the suite


def _check_reports(t: ExecutorUnderTest, quiet: float) -> None:
    """Every death reported exactly once (``may_report`` widens the range), nothing else reported."""
    spurious = sorted(set(t.spurious) - t.uncounted)
    _expect(not spurious, f"supervise: on_death was called for {spurious}, whose processes never ended "
                          "(a process being launched or restarted is not dead)")
    for name in [n for n in t.died if n not in t.uncounted]:
        t.wait_reported(name, t.died[name])
    time.sleep(quiet)  # long enough for a watcher to report a death twice
    seen = Counter(n for n, _ in t.reports)
    wrong = []
    for name in sorted(set(seen) | set(t.died) | set(t.may_report)):
        if name in t.uncounted:
            continue
        low, high = t.died[name], t.died[name] + t.may_report[name]
        if not low <= seen[name] <= high:
            expected = str(low) if low == high else f"{low} to {high}"
            wrong.append(f"{name!r}: {seen[name]} (expected {expected})")
    _expect(not wrong, "supervise: on_death calls per process are wrong (once per death): " + ", ".join(wrong))


def _check_shutdown(t: ExecutorUnderTest) -> None:
    for row in t.executor.manifest():
        pid = row.get("pid")
        if isinstance(pid, int) and t.running(pid):
            t.pids.setdefault(pid, f"process {row.get('name')!r}")
    t.executor.shutdown()
    deadline = time.monotonic() + t.timeout
    while (left := sorted(p for p in t.pids if t.running(p))) and time.monotonic() < deadline:
        time.sleep(0.1)
    _expect(not left, f"shutdown() left processes behind ({len(t.pids)} seen started): "
                      + ", ".join(f"pid {p}, {t.pids[p]}" for p in left))


def check_executor(make_executor: Callable[[Path], Executor], run_dir: Path, *, only: Sequence[str] | None = None,
                   skip: Iterable[str] = (), timeout: float = 60.0, quiet: float = 3.0) -> None:
    """Run the suite on one executor; raises one ``AssertionError`` naming every check that failed.

    :param make_executor: ``(run_dir) -> Executor``: a fresh executor for that run folder.
    :param run_dir: an empty folder for the run (logs go to ``run_dir/logs``).
    :param only: names of :data:`EXECUTOR_CHECKS` to run (default: all). With ``supervise`` among
        them, the watcher is installed before the first check and every check's deaths are
        tallied at the end; the shutdown check always runs.
    :param skip: names not to run (say why where you call it: a known defect of the executor).
    :param timeout: seconds any one wait may take (start-up, a death noticed, a log copied).
    :param quiet: seconds to watch for a second report of the last death: at least two of the
        executor's supervision intervals.
    """
    names = [n for n in (only or list(EXECUTOR_CHECKS)) if n not in set(skip)]
    unknown = [n for n in names if n not in EXECUTOR_CHECKS]
    if unknown:
        raise ValueError(f"no executor checks {unknown}; they are {list(EXECUTOR_CHECKS)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    t = ExecutorUnderTest(make_executor(run_dir), run_dir, timeout=timeout)
    failures: list[str] = []
    try:
        reserved = t.executor.reserve(0)
        _expect(bool(reserved), f"reserve(0) returned {reserved!r}; expected the driver's node")
        t.node = reserved[0].name
        watched = "supervise" in names
        if watched:
            t.executor.supervise(t.on_death)
        for name in names:
            before = set(t.calls)
            try:
                EXECUTOR_CHECKS[name](t)
            except AssertionError as exc:
                failures.append(f"{name}: {exc}")
                t.uncounted |= set(t.calls) - before
            except Exception as exc:
                failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
                t.uncounted |= set(t.calls) - before
        if watched:
            try:
                _check_reports(t, quiet)
            except AssertionError as exc:
                failures.append(f"supervise (every check's deaths): {exc}")
    finally:
        try:
            _check_shutdown(t)
        except AssertionError as exc:
            failures.append(f"shutdown: {exc}")
        except Exception as exc:
            failures.append(f"shutdown: raised {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):  # whatever shutdown missed must not outlive the suite
                for pid in t.pids:
                    if t.running(pid):
                        os.kill(pid, signal.SIGKILL)
    if failures:
        raise AssertionError(f"{len(failures)} executor check(s) failed:\n" + "\n".join(f"  - {f}" for f in failures))


__all__ = ["EXECUTOR_CHECKS", "SERVER", "ExecutorUnderTest", "check_executor", "eventually", "get", "running"]
