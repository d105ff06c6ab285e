"""Router middleware over real HTTP: registration through the hook, chain order, and the shipped
``metrics``, ``access_log`` and ``concurrency_limit`` (stand-in engines: router_support)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from miles import hookimpl
from miles.context import context_for
from miles.errors import ConfigError, PluginError
from miles.kernel import Kernel
from miles.registry import UnknownNameError
from miles_contracts import RouterMiddlewareSpec, RunContext
from miles_router.middleware import build_middlewares
from router_support import StandinEngine, in_background, router_for, wait_until

PROMPT = {"input_ids": [1, 2, 3]}


class _Tagger:
    """Records the order requests pass it in, and stamps responses on the way out."""

    def __init__(self, ctx: RunContext, options: dict[str, Any]) -> None:
        self.label = options["label"]
        self.process = str(ctx.process)  # built with the context of the process it runs in

    async def __call__(self, request: Any, call_next: Any) -> Any:
        request.state.setdefault("inbound", []).append(self.label)
        response = await call_next(request)
        response.headers["x-inbound"] = ",".join(request.state["inbound"])
        response.headers["x-outbound"] = ",".join(filter(None, [response.headers.get("x-outbound"), self.label]))
        return response


class _TaggerPlugin:
    @hookimpl
    def miles_register_router_middlewares(self, register: Any) -> None:
        register("tag_outer", RouterMiddlewareSpec(_Tagger))
        register("tag_inner", RouterMiddlewareSpec(_Tagger))


@pytest.fixture(scope="module")
def ctx() -> RunContext:
    """A context of this (test) process with the installed plugins' middlewares."""
    return context_for()


@pytest.fixture
def kernel_with_taggers() -> Iterator[Kernel]:
    kernel = Kernel.load()
    kernel.register_plugin(_TaggerPlugin(), "test-router-taggers")
    try:
        yield kernel
    finally:
        kernel.unregister_plugin("test-router-taggers")


def test_registered_middlewares_run_in_config_order(engines: list[StandinEngine], kernel_with_taggers: Kernel) -> None:
    chain = build_middlewares(["tag_outer", "tag_inner"],
                              {"tag_outer": {"label": "outer"}, "tag_inner": {"label": "inner"}},
                              context_for(kernel=kernel_with_taggers))
    assert [link.middleware.process for link in chain] == ["cli", "cli"]
    with router_for([e.url for e in engines], middlewares=chain) as client:
        for response in (client.post("/generate", json=PROMPT), client.post("/flush_cache")):
            assert response.status_code == 200
            assert response.headers["x-inbound"] == "outer,inner"
            assert response.headers["x-outbound"] == "inner,outer"
        # the router's own endpoints are not part of the chain
        assert "x-inbound" not in client.get("/list_workers").headers


def test_unknown_middleware_and_bad_options_fail_at_start_up(ctx: RunContext) -> None:
    with pytest.raises(UnknownNameError, match=r"unknown router middleware 'metric'.*metrics \(miles-router") as info:
        build_middlewares(["metric"], {}, ctx)
    assert "Did you mean 'metrics'?" in str(info.value)
    with pytest.raises(ConfigError, match=r"router.middleware_options.metrics.window: Input should be greater than or equal to 1"):
        build_middlewares(["metrics"], {"metrics": {"window": 0}}, ctx)
    with pytest.raises(ConfigError, match=r"router.middleware_options.concurrency_limit.max_in_flight: Field required"):
        build_middlewares(["concurrency_limit"], {}, ctx)


def test_metrics_counts_requests_tokens_and_latency_per_worker(engines: list[StandinEngine], ctx: RunContext) -> None:
    a, b = engines
    with router_for([a.url, b.url], middlewares=build_middlewares(["metrics"], {}, ctx)) as client:
        for n in (1, 2, 3, 4):
            assert client.post("/generate", json={"input_ids": list(range(n))}).status_code == 200
        assert client.post("/pause_generation", json={}).status_code == 200
        client.post("/remove_worker", params={"url": a.url})
        client.post("/remove_worker", params={"url": b.url})
        abort = client.post("/generate", json=PROMPT).json()  # no worker left: the router aborts
        assert abort["meta_info"]["finish_reason"]["type"] == "abort"

        snapshot = client.get("/metrics").json()
        total = snapshot["metrics"]["total"]
        assert (total["requests"], total["errors"], total["aborts"]) == (6, 1, 1)
        assert total["tokens"] == {"prompt": 1 + 2 + 3 + 4, "completion": 8, "cached": 0}
        assert total["finish_reasons"] == {"length": 4, "abort": 1}
        latency = total["latency_s"]
        assert latency["count"] == 6 and latency["p50"] <= latency["p90"] <= latency["p99"]
        by_worker = snapshot["metrics"]["by_worker"]
        assert set(by_worker) == {a.url, b.url}
        assert sum(w["requests"] for w in by_worker.values()) == 4
        assert sum(w["tokens"]["completion"] for w in by_worker.values()) == 8
        assert snapshot["metrics"]["by_path"]["/pause_generation"]["requests"] == 1
        assert snapshot["router"]["in_flight"] == 0

        text = client.get("/metrics", params={"format": "prometheus"}).text
        assert f'miles_router_requests_total{{worker="{a.url}"}} 2' in text
        assert f'miles_router_tokens_total{{worker="{b.url}",kind="completion"}} 4' in text
        assert 'quantile="0.99"' in text


def test_access_log_writes_one_line_per_request(engines: list[StandinEngine], tmp_path: Path, ctx: RunContext) -> None:
    log_file = tmp_path / "logs" / "router.jsonl"
    chain = build_middlewares(["access_log"], {"access_log": {"path": str(log_file)}}, ctx)
    with router_for([e.url for e in engines], middlewares=chain) as client:
        client.post("/generate", json={**PROMPT, "rid": "r-1"}, headers={"X-SMG-Routing-Key": "sess"})
        client.post("/abort_request", json={"rid": "r-1"})
    first, second = (json.loads(line) for line in log_file.read_text().splitlines())
    assert first["path"] == "/generate" and first["rid"] == "r-1" and first["routing_key"] == "sess"
    assert first["status"] == 200 and first["attempts"] == 1 and first["finish_reason"]["type"] == "length"
    assert first["worker"] in {e.url for e in engines} and first["tried_workers"] == [first["worker"]]
    assert second["path"] == "/abort_request" and second["fanout"] is True and second["failed"] == []


def test_concurrency_limit_holds_requests_at_the_router(engines: list[StandinEngine], ctx: RunContext) -> None:
    for engine in engines:
        engine.release.clear()
    chain = build_middlewares(["concurrency_limit"], {"concurrency_limit": {"max_in_flight": 2}}, ctx)
    with router_for([e.url for e in engines], middlewares=chain) as client:
        futures = in_background([lambda: client.post("/generate", json=PROMPT) for _ in range(5)])
        wait_until(lambda: client.get("/metrics").json()["concurrency_limit"]["waiting"] == 3)
        assert client.get("/metrics").json()["router"]["in_flight"] == 2
        assert "miles_router_concurrency_waiting 3" in client.get("/metrics", params={"format": "prometheus"}).text
        # fan-outs are never queued behind generations
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        for engine in engines:
            engine.release.set()
        assert [f.result().status_code for f in futures] == [200] * 5
        assert client.get("/metrics").json()["concurrency_limit"] == {"max_in_flight": 2, "running": 0, "waiting": 0}


def test_a_middleware_that_says_it_reports_must_have_snapshot_and_prometheus(ctx: RunContext) -> None:
    """``RouterMiddlewareSpec.reports`` is checked when the chain is built, not when /metrics is asked."""
    class Silent:
        async def __call__(self, request, call_next):
            return await call_next(request)

    class Boasting:
        @hookimpl
        def miles_register_router_middlewares(self, register):
            register("boasting", RouterMiddlewareSpec(lambda ctx, options: Silent(), reports=True))

    ctx.kernel.register_plugin(Boasting(), "boasting")
    try:
        with pytest.raises(PluginError, match="'boasting'.*reports=True, but Silent has no snapshot"):
            build_middlewares(["boasting"], {}, ctx)
    finally:
        ctx.kernel.unregister_plugin("boasting")
