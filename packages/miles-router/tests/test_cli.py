"""``miles serve router`` as a real process, started from :func:`miles_router.router_command` with
a config file (as the RL loop's local executor starts it, with the run's ``config.yaml``). The
engine behind it is a stand-in on a thread of the test process (router_support.StandinEngine);
real engines are in test_reliability.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from miles.cli.main import main
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from miles_router import router_command
from router_support import StandinEngine, free_port


def test_serve_router_process_routes_and_reports_metrics(engines: list[StandinEngine], tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text("router:\n  middlewares: [metrics]\n  health_interval: 0.2\n")
    argv = router_command([engines[0].url], port=port, config_path=config)
    assert argv[argv.index("--config") + 1] == str(config) and "--health-interval" not in argv
    with LoggedProcess(argv, tmp_path / "router.log") as router:
        url = f"http://127.0.0.1:{port}"
        router.wait_healthy(url)
        auth = auth_headers()
        assert httpx.post(url + "/add_worker", params={"url": engines[1].url}, headers=auth).json()["added"] is True
        answers = [httpx.post(url + "/generate", json={"input_ids": [1, 2]}, headers=auth) for _ in range(4)]
        assert {a.headers["x-miles-worker"] for a in answers} == {e.url for e in engines}
        metrics = httpx.get(url + "/metrics", headers=auth).json()
        assert metrics["metrics"]["total"]["requests"] == 4
    assert router.process.returncode is not None


def test_serve_router_rejects_bad_arguments_with_a_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("router:\n  max_attempts: 0\n")
    cases = [
        (["--worker", "localhost:1"], "--worker: worker URL 'localhost:1' must start with http://"),
        (["--failure-threshold", "0"], "router.failure_threshold: Input should be greater than or equal to 1"),
        (["--middleware", "metrix"], "unknown router middleware 'metrix'"),
        (["--config", str(config)], "router.max_attempts: Input should be greater than or equal to 1"),
    ]
    for extra, says in cases:  # the CLI's own entry point, in this process: nothing gets to listen
        assert main(["serve", "router", "--port", str(free_port()), *extra]) == 2
        assert says in capsys.readouterr().err
