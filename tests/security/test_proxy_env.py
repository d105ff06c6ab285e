"""``HTTP_PROXY`` set, pointing at nothing, and no ``NO_PROXY``: a proxy for the outside world,
which cannot reach this machine's loopback. The run's own calls still work, because they never
go through a proxy (``miles.loopback``): the executor's health wait, the router's probes,
forwarding and fan-out, the weight transports' engine calls; and ``miles train`` puts the
loopback names in ``NO_PROXY`` for the clients Miles does not write (an agent's OpenAI client)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from miles.loopback import PROXY_VARIABLES, keep_loopback_off_proxies
from miles_contracts.wire.auth import auth_headers
from security_support import Served, free_port

DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch, engine: Served) -> Iterator[None]:
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, DEAD_PROXY)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with pytest.raises(httpx.ConnectError):  # a client that reads the environment goes to the proxy
        httpx.get(f"{engine.url}/health", timeout=5)
    yield


def test_the_executors_health_wait_does_not_use_the_proxy(dead_proxy: None, tmp_path: Path) -> None:
    from miles.executor.local import LocalExecutor

    executor = LocalExecutor(tmp_path, startup_timeout=30)
    port = free_port()
    try:
        executor.start("web", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                       health_url=f"http://127.0.0.1:{port}/")  # raised "not healthy after 30 s" before
    finally:
        executor.shutdown()


def test_the_router_reaches_its_engines_past_the_proxy(dead_proxy: None, engine: Served) -> None:
    from miles_router import RouterServer
    from miles_router.config import RouterSection

    section = RouterSection(health_interval=0.2, health_timeout=5.0)
    prompt = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    for forward_client in ("lean", "httpx"):
        with RouterServer([engine.url], section=section.model_copy(update={"forward_client": forward_client})) as router, \
                httpx.Client(base_url=router.url, timeout=60, headers=auth_headers(), trust_env=False) as client:
            assert client.get("/health").status_code == 200  # the probes reached the engine
            answer = client.post("/generate", json=prompt)
            assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2, answer.text
            assert client.post("/flush_cache").json()["success"] is True  # a fan-out


def test_weight_transport_engine_calls_do_not_use_the_proxy(dead_proxy: None, engine: Served) -> None:
    from miles_weights.engines import EngineCalls

    calls = EngineCalls(timeout=30)
    try:
        assert "weight_version" in calls.call(engine.url, "GET", "/server_info", step="a check")
    finally:
        calls.close()


def test_miles_train_keeps_loopback_off_the_proxy_for_every_other_client(engine: Served) -> None:
    environ = {"HTTPS_PROXY": DEAD_PROXY, "no_proxy": "corp.example"}
    assert keep_loopback_off_proxies(environ) == ["localhost", "127.0.0.1", "::1"]
    assert environ["NO_PROXY"] == environ["no_proxy"] == "corp.example,localhost,127.0.0.1,::1"
    assert keep_loopback_off_proxies(environ) == []  # already there
    assert keep_loopback_off_proxies({"NO_PROXY": ""}) == []  # no proxy: nothing to do
    with pytest.MonkeyPatch.context() as patch:
        for name in PROXY_VARIABLES:
            patch.setenv(name, DEAD_PROXY)
        patch.setenv("NO_PROXY", ",".join(["corp.example", "localhost", "127.0.0.1", "::1"]))
        with httpx.Client(timeout=10) as client:  # reads the environment, as an OpenAI client does
            assert client.get(f"{engine.url}/health").status_code == 200
