"""The service's contract: the run's token on every route but /health, bounded and validated
requests, templates copied into a fresh workspace, tests restored from the template."""

from __future__ import annotations

import httpx
import pytest
from miles_sandbox.client import SandboxClient, SandboxServiceError


def test_every_route_but_health_needs_the_token(sandbox_url: str) -> None:
    assert httpx.get(f"{sandbox_url}/health").status_code == 200
    assert httpx.get(f"{sandbox_url}/stats").status_code == 401
    assert httpx.post(f"{sandbox_url}/sandboxes", json={}).status_code == 401
    wrong = {"Authorization": "Bearer " + "x" * 32}
    assert httpx.post(f"{sandbox_url}/sandboxes", json={}, headers=wrong).status_code == 401


def test_bad_requests_are_refused_with_the_reason(sandbox_url: str, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    unknown = httpx.post(f"{sandbox_url}/sandboxes", json={"template": "../etc"}, headers=headers)
    assert unknown.status_code == 400 and "no template" in unknown.json()["detail"]
    missing = httpx.post(f"{sandbox_url}/sandboxes/nope/exec", json={"command": "ls"}, headers=headers)
    assert missing.status_code == 404
    huge = httpx.post(f"{sandbox_url}/sandboxes", content=b"{" + b" " * (2 << 20) + b"}",
                      headers={**headers, "Content-Type": "application/json"})
    assert huge.status_code == 413
    client = SandboxClient(sandbox_url, token=token)
    with client.lease() as lease, pytest.raises(SandboxServiceError, match="422"):
        lease.execute("ls", env={"BAD NAME": "x"})
    client.close()


def test_template_workspace_and_restore(sandbox_url: str, token: str) -> None:
    from miles_sandbox.swe.reward import run_tests
    from miles_sandbox.swe.settings import SweAgentSettings

    client = SandboxClient(sandbox_url, token=token)
    settings = SweAgentSettings(n_tests=2)
    with client.lease("adder") as lease:
        assert run_tests(lease, settings)["passed"] == 1  # add(0, 0) passes with the bug
        # an agent that deletes the tests gains nothing: they are put back before scoring
        lease.execute("rm -rf tests && sed -i 's/a - b/a + b/' adder.py")
        scored = run_tests(lease, settings)
        assert scored["passed"] == 2 and scored["total"] == 2
    client.close()


def test_a_sandbox_whose_executor_is_killed_is_replaced(sandbox_url: str, token: str) -> None:
    client = SandboxClient(sandbox_url, token=token)
    replaced = client.stats()["replaced"]
    with client.lease("adder") as lease:
        result = lease.execute("kill -9 $PPID; sleep 1")  # the executor started this shell
        assert result["returncode"] == -1 and "the sandbox died" in result["error"]
    assert client.stats()["replaced"] == replaced + 1
    with client.lease("adder") as lease:  # the pool is whole again
        assert lease.execute("echo fine")["output"] == "fine\n"
    client.close()


def test_a_run_of_mini_swe_agent_starts_the_sandbox_service_with_the_runs_config() -> None:
    import sys

    from miles.config import build_config
    from miles.kernel import Kernel
    from miles.loop.services import _waves, plan_services
    from miles.placement import plan_placement
    from miles_contracts import Endpoint, Node, ServiceLaunch

    kernel = Kernel.load()
    config = build_config({"rollout": {"generator": "agentic", "agent": "mini_swe_agent"}}, kernel=kernel)
    planned = plan_services(config, kernel, plan_placement(config.resources, [Node("local", "127.0.0.1")]))
    # the agent's spec asks for the role; it needs no other service, so it starts with the engines
    assert [[p.name for p in wave] for wave in _waves(planned)] == [["engine-0", "sandbox"], ["router"], ["session"]]
    sandbox = next(p for p in planned if p.role == "sandbox")
    argv = sandbox.service.command(ServiceLaunch(config, "/runs/r/config.yaml", "/models/m",
                                                 Endpoint("127.0.0.1", 4100), {}))
    assert argv[:3] == [sys.executable, "-m", "miles_sandbox"]
    assert argv[argv.index("--config") + 1] == "/runs/r/config.yaml" and argv[argv.index("--port") + 1] == "4100"
