"""mini-swe-agent's ``Environment`` protocol (``execute``, ``get_template_vars``, ``serialize``) over a
leased sandbox: the harness's bash commands run there instead of on the host."""

from __future__ import annotations

import platform
from typing import Any

from minisweagent.exceptions import Submitted
from pydantic import BaseModel

from miles_sandbox.client import Lease

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The first output line with which mini-swe-agent's prompts tell the model to end its task."""


class SandboxEnvironmentConfig(BaseModel):
    cwd: str = ""
    env: dict[str, str] = {}
    timeout: int = 30


class SandboxEnvironment:
    """Runs each action's ``command`` in ``lease`` (a fresh ``sh -c`` each time, as mini-swe-agent's
    local environment does); limits, timeouts and truncation come back as the harness's own
    ``exception_info``, so the model reads them as a tool result."""

    def __init__(self, lease: Lease, **kwargs: Any) -> None:
        self.lease = lease
        self.config = SandboxEnvironmentConfig(**kwargs)

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        result = self.lease.execute(str(action.get("command", "")), timeout_s=float(timeout or self.config.timeout),
                                    env=self.config.env, cwd=cwd or self.config.cwd or None)
        problems = []
        if result.get("error"):
            problems.append(str(result["error"]))
        if result.get("timed_out"):
            problems.append(f"the command was killed after {result['seconds']:.0f} s (its time limit)")
        if result.get("truncated"):
            problems.append("the output was too long: it was cut and the command stopped")
        output = {"output": result.get("output", ""), "returncode": -1 if result.get("timed_out") else result["returncode"],
                  "exception_info": "; ".join(problems)}
        self._check_finished(output)
        return output

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # the sandbox shares the host's kernel: uname is the host's
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}
