"""The sandbox service's HTTP API (FastAPI behind :class:`~miles_contracts.wire.guard.RequestGuard`:
every route but ``/health`` needs the run's token; bodies are bounded).

* ``POST /sandboxes`` ``{"template": name | null}`` -> ``{"sandbox_id", "workspace"}``: lease a warm
  sandbox whose ``/workspace`` is a fresh copy of the template (503 when none frees up in time).
* ``POST /sandboxes/{id}/exec`` ``{"command", "timeout_s", "env", "cwd"}`` -> the
  :class:`~miles_contracts`-free result: ``returncode``, ``output``, ``truncated``, ``timed_out``,
  ``seconds``, ``error``. A command that breaks its limits is a result, not an HTTP error.
* ``POST /sandboxes/{id}/restore`` ``{"paths": [...]}``: put those template paths back.
* ``DELETE /sandboxes/{id}``: give the sandbox back (emptied, probed if a command timed out).
* ``GET /stats``: the pool's counters. ``GET /health``: 200 once every sandbox is warm.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_sandbox.box import SandboxError
from miles_sandbox.config import SandboxSection
from miles_sandbox.pool import LeaseError, Pool

MAX_BODY_BYTES = 1 << 20
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LeaseRequest(_Request):
    template: str | None = Field(default=None, max_length=255)


class ExecRequest(_Request):
    command: str = Field(min_length=1, max_length=64 << 10)
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    env: dict[str, str] = Field(default_factory=dict, max_length=64)
    cwd: str | None = Field(default=None, max_length=1024)

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.fullmatch(name) or len(value) > 8192 or "\0" in value:
                raise ValueError(f"environment variable {name[:40]!r}: a name of letters, digits and _ "
                                 "and a value under 8 KiB without NUL")
        return env


class RestoreRequest(_Request):
    paths: list[str] = Field(min_length=1, max_length=256)


def create_app(section: SandboxSection) -> FastAPI:
    """The service's ASGI app (without the guard: :func:`guarded_app` adds it)."""
    pool = Pool(section)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="miles sandbox", lifespan=lifespan)
    app.state.pool = pool

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return pool.counts()

    @app.post("/sandboxes")
    async def lease(body: LeaseRequest) -> dict[str, str]:
        try:
            leased = await pool.acquire(body.template)
        except LeaseError as exc:
            raise HTTPException(400, str(exc)) from exc
        except TimeoutError as exc:
            raise HTTPException(503, f"no sandbox free within {section.acquire_timeout_s:g} s "
                                     f"(sandbox.pool_size={section.pool_size})") from exc
        except SandboxError as exc:
            raise HTTPException(500, f"could not prepare a sandbox: {exc}") from exc
        return {"sandbox_id": leased.lease_id, "workspace": "/workspace"}

    @app.post("/sandboxes/{sandbox_id}/exec")
    async def execute(sandbox_id: str, body: ExecRequest) -> dict[str, Any]:
        leased = _lease(pool, sandbox_id)
        try:
            result = await pool.execute(leased, body.command, timeout_s=body.timeout_s, env=body.env, cwd=body.cwd)
        except SandboxError as exc:  # the sandbox died under the command: a tool result, and a replacement
            leased.timed_out = True
            return {"returncode": -1, "output": "", "truncated": False, "timed_out": False, "seconds": 0.0,
                    "error": f"the sandbox died: {exc}"}
        return result.to_dict()

    @app.post("/sandboxes/{sandbox_id}/restore")
    async def restore(sandbox_id: str, body: RestoreRequest) -> dict[str, int]:
        leased = _lease(pool, sandbox_id)
        try:
            return {"files": await pool.restore(leased, body.paths)}
        except LeaseError as exc:
            raise HTTPException(400, str(exc)) from exc
        except SandboxError as exc:
            raise HTTPException(500, str(exc)) from exc

    @app.delete("/sandboxes/{sandbox_id}")
    async def release(sandbox_id: str) -> dict[str, bool]:
        try:
            await pool.release(sandbox_id)
        except LeaseError as exc:
            raise HTTPException(404, str(exc)) from exc
        return {"released": True}

    return app


def _lease(pool: Pool, sandbox_id: str) -> Any:
    try:
        return pool.lease(sandbox_id)
    except LeaseError as exc:
        raise HTTPException(404, str(exc)) from exc


def guarded_app(section: SandboxSection, token: str, allowed_hosts: list[str] | None = None) -> Any:
    """The app behind the run's guard: token on every route but ``/health``, bodies under 1 MiB."""
    from miles_contracts.wire.guard import RequestGuard

    app = create_app(section)
    return RequestGuard(app, token=token, max_body_bytes=MAX_BODY_BYTES, allowed_hosts=allowed_hosts or ())
