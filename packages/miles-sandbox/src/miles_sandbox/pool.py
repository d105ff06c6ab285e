"""The pool: warm sandboxes leased one per episode.

Every sandbox is started at start-up (warm: its namespaces and interpreter are up). A lease takes a
free one, empties its workspace and unpacks the task's template into it; giving it back empties it
again. A sandbox whose command timed out during a lease is probed (``ping``, then ``true``) before
anyone gets it again; a dead one, or one that fails the probe, is killed and replaced by a fresh
one. A lease nobody used for ``lease_idle_s`` is taken back (its agent died).
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import secrets
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles_sandbox.box import ExecResult, Sandbox, SandboxError
from miles_sandbox.config import SandboxSection

_PROBE_TIMEOUT_S = 5.0
_RESET_TIMEOUT_S = 30.0


class LeaseError(LookupError):
    """An unknown (or taken back) lease, or a template that cannot be used: the client's mistake."""


@dataclass
class Lease:
    lease_id: str
    sandbox: Sandbox
    template: str | None
    last_used: float = field(default_factory=time.monotonic)
    timed_out: bool = False


@dataclass
class PoolStats:
    started: int = 0
    replaced: int = 0
    probes: int = 0
    leases: int = 0
    commands: int = 0
    timeouts: int = 0


class Pool:
    """A fixed number of sandboxes (``section.pool_size``); async, one event loop."""

    def __init__(self, section: SandboxSection) -> None:
        self.section = section
        self.templates = Path(section.templates_dir).resolve() if section.templates_dir else None
        self.stats = PoolStats()
        self._free: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._leases: dict[str, Lease] = {}
        self._archives: dict[tuple[str, tuple[str, ...]], str] = {}
        self._reaper: asyncio.Task[None] | None = None

    def _uid(self, index: int) -> int | None:
        return self.section.base_uid + index if os.geteuid() == 0 else None

    async def _fresh(self, index: int) -> Sandbox:
        sandbox = Sandbox(index, self.section.limits, self.section.python, uid=self._uid(index))
        await sandbox.start()
        self.stats.started += 1
        return sandbox

    async def start(self) -> None:
        for sandbox in await asyncio.gather(*(self._fresh(i) for i in range(self.section.pool_size))):
            self._free.put_nowait(sandbox)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for lease in list(self._leases.values()):
            await lease.sandbox.kill()
        while not self._free.empty():
            await self._free.get_nowait().kill()

    def counts(self) -> dict[str, int]:
        """The counters (``PoolStats``) and how many sandboxes are free and leased now."""
        return {**vars(self.stats), "free": self._free.qsize(), "leased": len(self._leases),
                "pool_size": self.section.pool_size}

    # ------------------------------------------------------------------ leases

    async def acquire(self, template: str | None) -> Lease:
        archive = self.archive(template) if template else None
        # TimeoutError (no sandbox free in time) reaches the client as 503
        sandbox = await asyncio.wait_for(self._free.get(), self.section.acquire_timeout_s)
        try:
            await self._reset(sandbox, archive)
        except SandboxError:
            sandbox = await self._replace(sandbox)
            await self._reset(sandbox, archive)
        lease = Lease(secrets.token_urlsafe(16), sandbox, template)
        self._leases[lease.lease_id] = lease
        self.stats.leases += 1
        return lease

    def lease(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseError(f"no sandbox {lease_id!r} (released, taken back after lease_idle_s, or the service restarted)")
        lease.last_used = time.monotonic()
        return lease

    async def release(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseError(f"no sandbox {lease_id!r}")
        await self._give_back(lease)

    async def _give_back(self, lease: Lease) -> None:
        sandbox = lease.sandbox
        try:
            if lease.timed_out or not sandbox.alive:
                self.stats.probes += 1
                await self._probe(sandbox)
            await self._reset(sandbox, None)
            # the executor lives under the commands' RLIMIT_CPU: retire it well before it hits it
            answer = await sandbox.request({"op": "ping"}, _PROBE_TIMEOUT_S)
            if float(answer.get("cpu_s", 0.0)) > self.section.limits.cpu_s / 2:
                raise SandboxError(f"sandbox {sandbox.index} used half its CPU limit: retired")
        except SandboxError:
            sandbox = await self._replace(sandbox)
        self._free.put_nowait(sandbox)

    async def _probe(self, sandbox: Sandbox) -> None:
        answer = await sandbox.request({"op": "ping"}, _PROBE_TIMEOUT_S)
        if answer.get("ok") is not True:
            raise SandboxError(f"sandbox {sandbox.index} failed its ping: {answer}")
        result = await sandbox.execute("true", timeout_s=_PROBE_TIMEOUT_S)
        if result.returncode != 0:
            raise SandboxError(f"sandbox {sandbox.index} cannot run `true`: {result.to_dict()}")

    async def _replace(self, sandbox: Sandbox) -> Sandbox:
        await sandbox.kill()
        self.stats.replaced += 1
        return await self._fresh(sandbox.index)

    async def _reset(self, sandbox: Sandbox, archive: str | None) -> None:
        answer = await sandbox.request({"op": "reset", "archive": archive}, _RESET_TIMEOUT_S)
        if answer.get("ok") is not True:
            raise SandboxError(f"sandbox {sandbox.index} could not reset its workspace: {answer.get('error')}")

    async def execute(self, lease: Lease, command: str, *, timeout_s: float | None, env: dict[str, str],
                      cwd: str | None) -> ExecResult:
        wall = min(timeout_s or self.section.limits.wall_s, self.section.limits.wall_s)
        self.stats.commands += 1
        result = await lease.sandbox.execute(command, timeout_s=wall, env=env, cwd=cwd)
        lease.last_used = time.monotonic()
        if result.timed_out:
            self.stats.timeouts += 1
            lease.timed_out = True
        return result

    async def restore(self, lease: Lease, paths: list[str]) -> int:
        """Put ``paths`` of the lease's template back into its workspace (a reward's tests, as shipped)."""
        if lease.template is None:
            raise LeaseError("this sandbox was leased without a template: nothing to restore from")
        answer = await lease.sandbox.request({"op": "restore", "archive": self.archive(lease.template, paths)},
                                             _RESET_TIMEOUT_S)
        if answer.get("ok") is not True:
            raise SandboxError(f"restore failed: {answer.get('error')}")
        return int(answer.get("files", 0))

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.section.lease_idle_s / 2))
            now = time.monotonic()
            for lease_id, lease in list(self._leases.items()):
                if now - lease.last_used > self.section.lease_idle_s and lease_id in self._leases:
                    del self._leases[lease_id]
                    await self._give_back(lease)

    # ------------------------------------------------------------------ templates

    def archive(self, template: str, paths: list[str] | None = None) -> str:
        """The template folder (or ``paths`` of it) as a base64 gzipped tar; cached."""
        key = (template, tuple(paths or ()))
        if key in self._archives:
            return self._archives[key]
        folder = self._template_folder(template)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for rel in paths or ["."]:
                source = (folder / rel).resolve()
                if not source.is_relative_to(folder) or not source.exists():
                    raise LeaseError(f"{rel!r} is not a path of template {template!r}")
                tar.add(source, arcname=str(source.relative_to(folder)), filter=_plain_file)
        if buffer.tell() > self.section.max_template_mb * (1 << 20):
            raise LeaseError(f"template {template!r} packs to {buffer.tell() >> 20} MiB, over sandbox.max_template_mb")
        self._archives[key] = encoded = base64.b64encode(buffer.getvalue()).decode()
        return encoded

    def _template_folder(self, template: str) -> Path:
        if self.templates is None:
            raise LeaseError("the sandbox service has no templates (sandbox.templates_dir is unset)")
        folder = (self.templates / template).resolve()
        if "/" in template or template.startswith(".") or not folder.is_relative_to(self.templates) or not folder.is_dir():
            raise LeaseError(f"no template {template!r} in {self.templates}")
        return folder


def _plain_file(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    # links would point outside the template once unpacked; caches are not part of a task
    if info.issym() or info.islnk() or "__pycache__" in info.name:
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
