"""One sandbox: a ``bwrap`` process running the executor (:mod:`miles_sandbox.executor`), spoken to
over its stdin/stdout, one request at a time.

Isolation (bubblewrap, see docs/design/sandbox.md): new user, pid, network, ipc, uts and cgroup
namespaces (no network but a loopback of its own), every capability dropped, a new session (no
terminal to inject into), only ``/usr`` and ``/etc`` of the host visible and read-only, a fresh
``/proc`` and ``/dev``, ``/workspace`` and ``/tmp`` small tmpfs. As root, sandbox ``i`` runs as uid
``base_uid + i``: a uid with no files on the host, and a process limit of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_sandbox import executor
from miles_sandbox.config import SandboxLimits

WORKSPACE = "/workspace"
_TOOLS = "/opt/miles/bin"
PATH = f"{_TOOLS}:/usr/local/bin:/usr/bin:/bin"
_HOST_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ANSWER_LIMIT = 96 << 20  # an answer line: the output cap (64 MiB at most) plus JSON escaping


class SandboxError(RuntimeError):
    """A sandbox that cannot be started, or that died or answered nonsense."""


def bwrap_path() -> str:
    """The ``bwrap`` binary, or an error saying how to install it."""
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxError("bubblewrap is not installed: apt-get install -y bubblewrap (the sandbox service needs bwrap)")
    return found


def bwrap_argv(limits: SandboxLimits, python: str, *, bwrap: str = "bwrap") -> list[str]:
    """argv of one sandbox: bubblewrap around ``python -I -S -c <executor>``."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for entry in _HOST_ROOT_ENTRIES:  # merged /usr: /bin -> usr/bin; older systems: real folders
        path = Path("/") / entry
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    size = str(limits.workspace_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", WORKSPACE, "--size", size, "--tmpfs", "/tmp",
             # `python` is the sandbox's interpreter, whatever the host calls it (Debian has only python3)
             "--dir", _TOOLS, "--symlink", python, f"{_TOOLS}/python", "--symlink", python, f"{_TOOLS}/python3",
             "--chdir", WORKSPACE, "--clearenv", "--setenv", "PATH", PATH,
             "--setenv", "HOME", WORKSPACE, "--", python, "-I", "-S", "-c", Path(executor.__file__).read_text(), json.dumps(limits.rlimits())]
    return argv


def _drop_to(uid: int | None, processes: int) -> Callable[[], None]:
    def apply() -> None:
        # counted per user namespace level: in the sandbox's own namespace, and on the host for its uid
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return apply


@dataclass
class ExecResult:
    """What one command did (the service's answer to ``exec``)."""

    returncode: int
    output: str
    truncated: bool
    timed_out: bool
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"returncode": self.returncode, "output": self.output, "truncated": self.truncated,
                "timed_out": self.timed_out, "seconds": self.seconds, "error": self.error}


class Sandbox:
    """One running sandbox; :meth:`start` it, then :meth:`request` (one at a time), :meth:`kill`."""

    def __init__(self, index: int, limits: SandboxLimits, python: str, *, uid: int | None) -> None:
        self.index = index
        self.limits = limits
        self.python = python
        self.uid = uid
        self.process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, timeout: float = 30.0) -> None:
        argv = bwrap_argv(self.limits, self.python, bwrap=bwrap_path())
        self.process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_drop_to(self.uid, self.limits.processes), limit=_ANSWER_LIMIT, env={})
        try:
            ready = await self._read(timeout)
        except SandboxError:
            raise
        if ready.get("ready") is not True:
            await self.kill()
            raise SandboxError(f"sandbox {self.index} did not start: {ready}")

    async def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and wait for its answer; :class:`SandboxError` (the sandbox is then
        killed) when it does not answer in time or answers nonsense."""
        async with self._lock:
            if not self.alive or self.process is None or self.process.stdin is None:
                raise SandboxError(f"sandbox {self.index} is not running")
            self.process.stdin.write(json.dumps(payload).encode() + b"\n")
            try:
                await self.process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                await self.kill()
                raise SandboxError(f"sandbox {self.index} died: {exc}") from exc
            return await self._read(timeout)

    async def _read(self, timeout: float) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
            answer = json.loads(line) if line else None
        except (TimeoutError, ValueError) as exc:
            await self.kill()
            raise SandboxError(f"sandbox {self.index} did not answer properly: {type(exc).__name__}") from exc
        if not isinstance(answer, dict):
            stderr = await self._stderr()
            await self.kill()
            raise SandboxError(f"sandbox {self.index} ended: {stderr or 'no answer'}")
        return answer

    async def _stderr(self) -> str:
        if self.process is None or self.process.stderr is None:
            return ""
        try:
            return (await asyncio.wait_for(self.process.stderr.read(4096), 1.0)).decode("utf-8", "replace").strip()
        except TimeoutError:
            return ""

    async def execute(self, command: str, *, timeout_s: float, env: dict[str, str] | None = None,
                      cwd: str | None = None) -> ExecResult:
        answer = await self.request({
            "op": "exec", "command": command, "timeout_s": timeout_s, "max_output_bytes": self.limits.output_bytes,
            "env": env or {}, "cwd": cwd,
        }, timeout=timeout_s + 15.0)  # the executor kills at timeout_s; the rest is its clean-up
        try:
            return ExecResult(int(answer["returncode"]), str(answer["output"]), bool(answer["truncated"]),
                              bool(answer["timed_out"]), float(answer["seconds"]), answer.get("error"))
        except (KeyError, TypeError, ValueError) as exc:
            await self.kill()
            raise SandboxError(f"sandbox {self.index} answered an exec without {exc}: {str(answer)[:200]}") from exc

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
