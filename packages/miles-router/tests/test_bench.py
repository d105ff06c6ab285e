"""`miles bench rollout-path` runs end to end on a tiny burst (real engine, two real routers) and
reports every path; the numbers themselves are not asserted (timings never gate tests)."""

from __future__ import annotations

import json

from miles.cli.main import main


def test_rollout_path_bench_reports_every_path(tmp_path):
    out = tmp_path / "path.json"
    assert main(["bench", "rollout-path", "--requests", "8", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"direct_httpx", "direct_lean", "router_httpx", "router_lean"}
    for entry in report["paths"].values():
        assert entry["wall_s_median"] > 0 and entry["requests_per_s"] > 0 and entry["engine_s_median"] >= 0
    assert set(report["ratios"]) == {"router_httpx/router_lean", "direct_httpx/direct_lean"}
