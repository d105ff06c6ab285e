"""The router in front of two real engine processes (``miles serve engine``, tiny random Llama).

One engine is SIGKILLed while 64 requests are in flight: every request must end with an answer or
an abort that says why, and the dead engine must be quarantined. Restarted on the same port, it
comes back with its initial weights while the fleet has moved on: the router holds it back, and
re-admits it once the next weight update has reached it.
Engines and router are real processes; the engines are shared by the tests of this module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from miles.config import build_config
from miles.kernel import Kernel
from miles_contracts import Endpoint, ServiceLaunch
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.engine import ROUTING_KEY_HEADER, GenerateResponse
from miles_router import router_command
from router_support import free_port, wait_until

pytestmark = pytest.mark.slow

ENGINE_ENV = {"OMP_NUM_THREADS": "1"}  # two engines share the test machine's cores


class Cluster:
    """Two engine processes and a router process; engines can be killed and restarted."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model = model
        self.logs = logs
        self.ports = [free_port(), free_port()]
        self.engines: dict[int, LoggedProcess] = {}
        self.processes: list[LoggedProcess] = []  # every one ever started, stopped at the end
        self.router: LoggedProcess | None = None
        self.url = f"http://127.0.0.1:{free_port()}"
        self.client = httpx.Client(base_url=self.url, timeout=120, headers=auth_headers())

    def engine_url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def start_engine(self, port: int) -> LoggedProcess:
        # The argv the run's executor uses: the registered engine's command (``miles serve engine``
        # without the CLI's plugin loading in front).
        config = build_config({"model": {"device": "cpu", "dtype": "float32"}})
        config_path = self.logs / "engine.yaml"  # as a run's config.yaml: what the process reads
        config_path.write_text(config.to_yaml())
        launch = ServiceLaunch(config, str(config_path), str(self.model), Endpoint("127.0.0.1", port))
        argv = Kernel.load().services().get("embedded").command(launch)
        run = len([p for p in self.logs.iterdir() if p.name.startswith(f"engine-{port}")])
        self.engines[port] = LoggedProcess(argv, self.logs / f"engine-{port}-{run}.log", env=ENGINE_ENV)
        self.processes.append(self.engines[port])
        return self.engines[port].start()

    def start(self) -> None:
        for port in self.ports:
            self.start_engine(port)
        for port in self.ports:
            self.engines[port].wait_healthy(self.engine_url(port))
        config_path = self.logs / "router.yaml"
        config_path.write_text("router: {middlewares: [metrics], health_interval: 0.25, failure_threshold: 2, "
                               "health_timeout: 5}\n")
        argv = router_command([self.engine_url(p) for p in self.ports], port=int(self.url.rsplit(":", 1)[1]),
                              config_path=config_path)
        self.router = LoggedProcess(argv, self.logs / "router.log")
        self.processes.append(self.router)
        self.router.start()
        self.router.wait_healthy(self.url)
        self.router.wait_ready(lambda: self.client.get("/list_workers").json()["counts"]["healthy"] == 2,
                               "the router to see both engines healthy")

    def worker(self, port: int) -> dict[str, Any]:
        url = self.engine_url(port)
        return next(w for w in self.client.get("/list_workers").json()["workers"] if w["url"] == url)

    def stop(self) -> None:
        self.client.close()
        for process in self.processes:
            process.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from miles_models.testing import tiny_model

    running = Cluster(tiny_model("dense"), tmp_path_factory.mktemp("router-reliability"))
    try:
        running.start()
        yield running
    finally:
        running.stop()


def _prompt(i: int, max_new_tokens: int = 8) -> dict[str, Any]:
    return {"input_ids": [1, 100 + i, 200 + i, 300], "rid": f"req-{i}",
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}


def test_real_engines_answer_through_the_router(cluster: Cluster) -> None:
    served = set()
    for i in range(4):
        response = cluster.client.post("/generate", json=_prompt(i), headers={ROUTING_KEY_HEADER: "session-a"})
        answer = GenerateResponse.model_validate(response.json())
        assert response.status_code == 200 and answer.meta_info.finish_reason.type == "length"
        assert len(answer.output_ids) == 8 and answer.meta_info.weight_version is not None
        served.add(response.headers["x-miles-worker"])
    assert len(served) == 1  # one session, one engine
    text = cluster.client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}})
    assert text.status_code == 200 and text.json()["meta_info"]["completion_tokens"] <= 4
    assert cluster.client.get("/get_model_info").json()["model_path"]
    fanout = cluster.client.post("/flush_cache").json()
    assert fanout["success"] is True and len(fanout["workers"]) == 2


def test_requests_on_a_frozen_engine_fail_over_within_the_request_timeout(cluster: Cluster) -> None:
    """SIGSTOP: the engine keeps its connections open and answers nothing, not even its health
    probes. It is quarantined after two probes time out, and the requests waiting on it go to the
    other engine, well within ``request_timeout`` (they used to wait all of it, then end as aborts).
    A router of its own in this process, with a 60 s request timeout."""
    import os
    import signal

    from router_support import in_background, router_for

    victim, survivor = cluster.ports
    frozen = cluster.engines[victim].process.pid  # the leader of its own process group
    settings = {"health_interval": 0.2, "health_timeout": 1.0, "failure_threshold": 2, "request_timeout": 60.0}
    with router_for([cluster.engine_url(p) for p in cluster.ports], **settings) as router, \
            httpx.Client(base_url=router.server.url, timeout=180, headers=auth_headers()) as client:
        wait_until(lambda: [w["state"] for w in client.get("/list_workers").json()["workers"]] == ["healthy"] * 2,
                   timeout=60)
        futures = in_background([lambda i=i: client.post("/generate", json=_prompt(i, max_new_tokens=200))
                                 for i in range(16)])
        wait_until(lambda: worker_of(client, victim)["in_flight"] > 0, timeout=60)
        os.killpg(frozen, signal.SIGSTOP)
        try:
            on_victim = worker_of(client, victim)["in_flight"]
            responses = [f.result(timeout=170) for f in futures]
            assert worker_of(client, victim)["state"] == "quarantined"
        finally:
            os.killpg(frozen, signal.SIGCONT)
    assert on_victim > 0
    reasons = [GenerateResponse.model_validate(r.json()).meta_info.finish_reason for r in responses]
    assert [r.type for r in reasons] == ["length"] * 16, [r.message for r in reasons if r.type != "length"]
    moved = [r for r in responses if r.headers["x-miles-attempts"] == "2"]
    assert len(moved) >= on_victim and all(r.headers["x-miles-worker"] == cluster.engine_url(survivor) for r in moved)
    wait_until(lambda: cluster.worker(victim)["state"] == "healthy", timeout=60)  # thawed, for the next tests


def worker_of(client: httpx.Client, port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    return next(w for w in client.get("/list_workers").json()["workers"] if w["url"] == url)


async def _generate_all(cluster: Cluster, victim: int, n: int = 64) -> tuple[list[httpx.Response], int]:
    """Send ``n`` requests at once; SIGKILL ``victim`` once the router has dispatched them all."""
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=300, limits=limits, headers=auth_headers()) as client:
        baseline = sum(w["dispatched"] for w in (await client.get("/list_workers")).json()["workers"])
        tasks = [asyncio.create_task(client.post("/generate", json=_prompt(i, max_new_tokens=32))) for i in range(n)]
        while True:  # until the router has placed every request (its own counters, not a timer)
            workers = (await client.get("/list_workers")).json()["workers"]
            if sum(w["dispatched"] for w in workers) - baseline >= n or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        on_victim = next(w["in_flight"] for w in workers if w["url"] == cluster.engine_url(victim))
        cluster.engines[victim].kill()
        return list(await asyncio.gather(*tasks)), on_victim


def test_sigkill_with_64_requests_in_flight_loses_none_and_the_engine_comes_back(cluster: Cluster) -> None:
    victim, survivor = cluster.ports
    # The fleet moves past the engines' initial weights, as after a first training step: a
    # restarted engine comes back behind it.
    initial = int(cluster.worker(victim)["weight_version"])
    fleet_version = str(initial + 1)
    assert cluster.client.post("/update_weight_version", json={"new_version": fleet_version}).status_code == 200
    before = cluster.client.get("/metrics").json()["metrics"]["total"]["requests"]

    responses, on_victim = asyncio.run(_generate_all(cluster, victim))

    assert on_victim > 0, "the victim must hold requests when it is killed"
    assert len(responses) == 64
    aborted = 0
    for response in responses:
        assert response.status_code == 200, response.text
        reason = GenerateResponse.model_validate(response.json()).meta_info.finish_reason
        if reason.type == "abort":
            assert reason.message, "an abort must say why"
            aborted += 1
        else:
            assert reason.type == "length"
    failed_over = [r for r in responses if r.headers.get("x-miles-attempts") == "2"]
    assert len(failed_over) >= on_victim - aborted  # everything the victim held went elsewhere
    assert all(r.headers["x-miles-worker"] == cluster.engine_url(survivor) for r in failed_over)

    view = cluster.worker(victim)
    assert view["state"] == "quarantined" and view["in_flight"] == 0
    assert cluster.worker(survivor)["state"] == "healthy"
    metrics = cluster.client.get("/metrics").json()["metrics"]["total"]
    assert metrics["requests"] - before == 64 and metrics["failovers"] >= len(failed_over)

    # Restarted on the same port it answers again, but with its initial weights: held back.
    cluster.start_engine(victim).wait_healthy(cluster.engine_url(victim))
    cluster.router.wait_ready(lambda: cluster.worker(victim)["state"] == "stale_weights",
                              "the router to hold the restarted engine back")
    assert f"weight_version {initial} is behind the fleet's {fleet_version}" in cluster.worker(victim)["reason"]
    for i in range(4):
        response = cluster.client.post("/generate", json=_prompt(i))
        assert response.headers["x-miles-worker"] == cluster.engine_url(survivor)
        assert str(response.json()["meta_info"]["weight_version"]) == fleet_version

    # The next weight update reaches it too; it is re-admitted and gets requests again.
    newer = str(initial + 2)
    assert cluster.client.post("/update_weight_version", json={"new_version": newer}).status_code == 200
    assert cluster.worker(victim)["state"] == "healthy" and cluster.worker(victim)["weight_version"] == newer
    dispatched = cluster.worker(victim)["dispatched"]
    for i in range(4):
        assert cluster.client.post("/generate", json=_prompt(i)).status_code == 200
    assert cluster.worker(victim)["dispatched"] > dispatched
