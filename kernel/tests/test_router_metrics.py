"""`miles.loop.router_metrics`: the router's cumulative prefix counters become per-step metrics."""

from __future__ import annotations

import asyncio

from miles.loop.router_metrics import RouterCounters


def _snapshot(prompt: int, cached: int, placed: int | None = None, matched: int | None = None) -> dict:
    # the shape of the router's GET /metrics (packages/miles-router/tests/test_prefix_routing.py reads the same keys)
    snap: dict = {"router": {"in_flight": 0},
                  "metrics": {"total": {"tokens": {"prompt": prompt, "completion": 9, "cached": cached}}}}
    if placed is not None:
        snap["prefix_routing"] = {"prompt_tokens": placed, "matched_tokens": matched, "hit_rate": 0.5}
    return snap


def test_each_step_reports_what_it_added_to_the_totals():
    counters = RouterCounters()
    first = counters.step_metrics(_snapshot(100, 0, placed=100, matched=0))
    assert first == {"router/prefix_cache_prompt_tokens": 100.0, "router/prefix_cache_hit_tokens": 0.0,
                     "router/prefix_cache_hit_rate": 0.0, "router/prefix_routing_prompt_tokens": 100.0,
                     "router/prefix_routing_hit_tokens": 0.0, "router/prefix_routing_hit_rate": 0.0}
    second = counters.step_metrics(_snapshot(300, 150, placed=300, matched=50))
    assert second["router/prefix_cache_hit_rate"] == 0.75  # 150 of the step's 200 prompt tokens
    assert second["router/prefix_routing_hit_rate"] == 0.25
    idle = counters.step_metrics(_snapshot(300, 150, placed=300, matched=50))
    assert idle["router/prefix_cache_prompt_tokens"] == 0.0 and "router/prefix_cache_hit_rate" not in idle


def test_a_restarted_router_and_missing_counters_give_no_figure():
    counters = RouterCounters()
    counters.step_metrics(_snapshot(500, 200))
    assert counters.step_metrics(_snapshot(40, 10)) == {}  # totals went down: the router started again
    assert counters.step_metrics(_snapshot(100, 40))["router/prefix_cache_hit_rate"] == 0.5  # from the new totals
    assert counters.step_metrics({"router": {"in_flight": 1}}) == {}  # no metrics middleware, no prefix policy
    assert counters.step_metrics({"metrics": {"total": {"tokens": {"prompt": "x", "cached": 1}}}}) == {}


def test_the_router_is_read_with_the_runs_token_and_a_silent_one_costs_nothing(monkeypatch):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    monkeypatch.setenv("MILES_AUTH_TOKEN", "a-run-token-of-enough-length")
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server dispatches a GET to do_GET
            seen.append(self.headers.get("Authorization"))
            body = json.dumps(_snapshot(10, 5)).encode() if self.path == "/metrics" else b"{}"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        counters = RouterCounters()
        assert asyncio.run(counters.fetch(url))["router/prefix_cache_hit_rate"] == 0.5
        assert seen == ["Bearer a-run-token-of-enough-length"]
        assert asyncio.run(counters.fetch(url + "/nothing-here")) == {}  # a 404: no figures, no error
    finally:
        server.shutdown()
        server.server_close()
    assert asyncio.run(RouterCounters().fetch(url)) == {}  # nobody listens any more
    assert asyncio.run(RouterCounters().fetch(None)) == {}  # a run without a router
