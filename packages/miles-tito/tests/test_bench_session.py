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
    # 256 sessions were not run: the goal is not judged rather than judged met
    assert report["goal_met"] == {"stub": dict.fromkeys(CONVERSATIONS)}


def test_the_goal_is_judged_per_engine_kind_and_api() -> None:
    level = {"concurrency": 256, "added_latency_p50_ms": 0.9, "added_latency_p99_ms": 7.0}
    kinds = {"stub": {"apis": {"chat": [level], "messages": [{**level, "added_latency_p99_ms": 4.0}]}}}
    assert session.goal_met(kinds) == {"stub": {"chat": {"p50": True, "p99": False, "met": False},
                                                "messages": {"p50": True, "p99": True, "met": True}}}


def test_an_unknown_api_is_refused_with_the_names_it_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert session.run(bench_args(tmp_path / "x.json", apis="chat,anthropic")) == 2
    assert "anthropic" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
