"""Scoring a SWE episode: the share of the task's tests that pass, measured in the episode's own
sandbox after the harness stopped (test files put back from the template first), read by the
``swe_tests`` reward from ``sample.metadata["agent_result"]["tests"]``."""

from __future__ import annotations

import re
from typing import Any

from miles_contracts import Sample

from miles_sandbox.client import Lease
from miles_sandbox.swe.settings import SweAgentSettings

_RAN = re.compile(r"^Ran (\d+) tests? in", re.M)
_FAILED = re.compile(r"^FAILED \(([^)]*)\)", re.M)


def passed_tests(output: str) -> int:
    """Tests ``unittest`` reported as passing in ``output`` (run minus failures and errors)."""
    ran = _RAN.findall(output)
    if not ran:
        return 0
    bad = 0
    for summary in _FAILED.findall(output):
        bad += sum(int(n) for key, n in re.findall(r"(\w+)=(\d+)", summary) if key in ("failures", "errors"))
    return max(0, int(ran[-1]) - bad)


def run_tests(lease: Lease, settings: SweAgentSettings, timeout_s: float = 60.0) -> dict[str, Any]:
    """Put the template's tests back and run them; ``{"passed", "total", "returncode", "output"}``."""
    lease.restore(settings.tests)
    result = lease.execute(settings.test_command, timeout_s=timeout_s)
    output = str(result.get("output", ""))
    return {"passed": min(passed_tests(output), settings.n_tests), "total": settings.n_tests,
            "returncode": result.get("returncode"), "timed_out": bool(result.get("timed_out")), "output": output[-2000:]}


def tests_passed_share(sample: Sample) -> float:
    """The reward: passed / total of the episode's test run; 0 when the episode never got to run them."""
    result = sample.metadata.get("agent_result")
    tests = result.get("tests") if isinstance(result, dict) else None
    if not isinstance(tests, dict) or not tests.get("total"):
        return 0.0
    return float(tests["passed"]) / float(tests["total"])
