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


def test_a_router_that_fails_or_cannot_answer_costs_nothing():
    class Failing:
        async def get(self, path: str) -> dict:
            raise ConnectionError("refused")

    class Answering:
        async def get(self, path: str) -> dict:
            assert path == "/metrics"
            return _snapshot(10, 5)

    counters = RouterCounters()
    assert asyncio.run(counters.fetch(Failing())) == {}
    assert asyncio.run(counters.fetch(object())) == {}  # a client without get (a test's stand-in)
    assert asyncio.run(counters.fetch(Answering()))["router/prefix_cache_hit_rate"] == 0.5
