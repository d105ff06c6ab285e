"""A small synchronous client of the sandbox service (the mini-swe-agent environment and the SWE
reward use it; ``httpx``, the run's token, no proxy)."""

from __future__ import annotations

from typing import Any

import httpx
from miles_contracts.wire.auth import auth_headers

_SLACK_S = 30.0  # beyond a command's own wall limit: leasing, clean-up, the HTTP round trip


class SandboxClient:
    """One lease at a time: ``with SandboxClient(url).lease("task-3") as box: box.execute("ls")``."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 120.0) -> None:
        self._http = httpx.Client(base_url=url, headers=auth_headers(token), timeout=timeout_s + _SLACK_S,
                                  trust_env=False)

    def lease(self, template: str | None = None) -> Lease:
        response = self._http.post("/sandboxes", json={"template": template})
        _raise_for(response)
        return Lease(self._http, response.json()["sandbox_id"])

    def stats(self) -> dict[str, Any]:
        response = self._http.get("/stats")
        _raise_for(response)
        return dict(response.json())

    def close(self) -> None:
        self._http.close()


class Lease:
    """A leased sandbox; released on ``close`` (or leaving its ``with``)."""

    def __init__(self, http: httpx.Client, sandbox_id: str) -> None:
        self._http = http
        self.sandbox_id = sandbox_id

    def execute(self, command: str, *, timeout_s: float | None = None, env: dict[str, str] | None = None,
                cwd: str | None = None) -> dict[str, Any]:
        response = self._http.post(f"/sandboxes/{self.sandbox_id}/exec",
                                   json={"command": command, "timeout_s": timeout_s, "env": env or {}, "cwd": cwd})
        _raise_for(response)
        return dict(response.json())

    def restore(self, paths: list[str]) -> int:
        response = self._http.post(f"/sandboxes/{self.sandbox_id}/restore", json={"paths": paths})
        _raise_for(response)
        return int(response.json()["files"])

    def close(self) -> None:
        response = self._http.delete(f"/sandboxes/{self.sandbox_id}")
        if response.status_code != 404:  # already taken back: nothing to give
            _raise_for(response)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SandboxServiceError(RuntimeError):
    """The service refused a request (the status and its reason)."""


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text[:500]
    raise SandboxServiceError(f"sandbox service: {response.status_code} {detail}")
