"""``miles bench session`` end to end at a tiny size: its real processes (the stand-in engine of
``--engine-kind stub`` and a ``miles serve session`` process, both on loopback), every wire API,
two concurrency levels, one turn. What is asserted is the report a reader relies on -- its shape,
that every request of every level succeeded and was measured -- never a timing.

The stand-in engine is the bench's own (it exists so the bench measures the server alone); the
embedded engine is left out here only to keep this test fast."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from miles_tito.bench import session
from miles_tito.bench.session_apis import CONVERSATIONS

pytestmark = pytest.mark.slow

LEVEL_KEYS = {
    "concurrency", "sessions", "requests", "failed_sessions", "errors", "added_latency_p50_ms", "added_latency_p99_ms",
    "added_latency_mean_ms", "session_wait_p50_ms", "session_wait_p99_ms", "direct_wait_p50_ms", "direct_wait_p99_ms",
    "session_requests_per_s", "direct_requests_per_s", "throughput_ratio", "server_cpu_ms_per_request",
    "think_ms_mean", "offered_turns_per_s", "turns_per_s", "server_cpu_utilisation",
}


def bench_args(out: Path, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    session.add_arguments(parser)
    args = parser.parse_args(["--engine-kind", "stub", "--apis", ",".join(CONVERSATIONS), "--concurrency", "1,2",
                              "--turns", "1", "--sessions-per-worker", "1", "--min-requests", "1", "--out", str(out)])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_every_api_and_level_is_measured_and_every_request_succeeds(tmp_path: Path) -> None:
    out = tmp_path / "session.json"
    assert session.run(bench_args(out)) == 0
    report = json.loads(out.read_text())
    assert report["goal"] == {"concurrency": 256, "added_latency_p50_ms": 1.0, "added_latency_p99_ms": 5.0}
    assert report["load"] == {"mode": "closed-loop", "think_ms": None}
    stub = report["engine_kinds"]["stub"]
    assert "stands in for an engine only" in stub["engine"]
    assert list(stub["apis"]) == list(CONVERSATIONS)
    for api, levels in stub["apis"].items():
        assert [level["concurrency"] for level in levels] == [1, 2], api
        for level in levels:
            assert set(level) == LEVEL_KEYS
            assert level["failed_sessions"] == 0 and level["errors"] == [], (api, level["errors"])
            assert level["requests"] == level["sessions"] == level["concurrency"]  # one turn per session
            assert level["session_requests_per_s"] > 0 and level["direct_requests_per_s"] > 0
            assert level["think_ms_mean"] == 0 and level["offered_turns_per_s"] is None  # closed loop
            assert level["turns_per_s"] > 0 and level["server_cpu_utilisation"] >= 0
    # 256 sessions were not run: the goal is not judged rather than judged met
    assert report["goal_met"] == {"stub": dict.fromkeys(CONVERSATIONS)}


def test_think_times_are_waited_before_each_turn_and_the_load_reported(tmp_path: Path) -> None:
    """``--think-ms``: every turn of every session waits a drawn think time first (their mean lies
    in the range), the offered load follows from it, the direct pass is skipped (null, not NaN),
    and every request still succeeds and is measured."""
    out = tmp_path / "think.json"
    args = bench_args(out, apis="chat", concurrency="1,3", turns=2, think_ms=session.think_range("20-40"))
    assert session.run(args) == 0
    report = json.loads(out.read_text())
    assert report["load"] == {"mode": "think-time", "think_ms": {"min": 20.0, "max": 40.0}}
    for level in report["engine_kinds"]["stub"]["apis"]["chat"]:
        assert set(level) == LEVEL_KEYS
        assert level["failed_sessions"] == 0 and level["requests"] == 2 * level["concurrency"]
        assert 20 <= level["think_ms_mean"] <= 40
        assert level["offered_turns_per_s"] == pytest.approx(level["concurrency"] / (level["think_ms_mean"] / 1e3), rel=0.01)
        assert level["direct_requests_per_s"] is None and level["throughput_ratio"] is None
        assert level["turns_per_s"] > 0


@pytest.mark.parametrize("text", ["fast", "50-10", "-5", "10-inf"])
def test_a_bad_think_time_is_refused_saying_what_is_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="MIN"):
        session.think_range(text)


def test_think_ranges_read_as_milliseconds() -> None:
    assert session.think_range("0") == (0.0, 0.0)
    assert session.think_range("100") == (100.0, 100.0)
    assert session.think_range("250-750") == (250.0, 750.0)


def test_the_goal_is_judged_per_engine_kind_and_api_with_its_load() -> None:
    level = {"concurrency": 256, "added_latency_p50_ms": 0.9, "added_latency_p99_ms": 7.0, "turns_per_s": 400.0,
             "server_cpu_utilisation": 0.4}
    kinds = {"stub": {"apis": {"chat": [level], "messages": [{**level, "added_latency_p99_ms": 4.0}]}}}
    load = {"turns_per_s": 400.0, "server_cpu_utilisation": 0.4}
    assert session.goal_met(kinds) == {"stub": {"chat": {"p50": True, "p99": False, "met": False, **load},
                                                "messages": {"p50": True, "p99": True, "met": True, **load}}}


def test_an_unknown_api_is_refused_with_the_names_it_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert session.run(bench_args(tmp_path / "x.json", apis="chat,anthropic")) == 2
    assert "anthropic" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
