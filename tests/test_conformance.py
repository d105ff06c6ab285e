"""``miles bench conformance`` on a small setting: every SDK agent (Chat, Messages, Responses) and
the verifiers, OpenEnv and mini-swe-agent adapters (the OpenEnv environment served by openenv-core
on loopback, mini-swe-agent's commands in a bubblewrap sandbox)
run real episodes on the tiny model through a real session server; every turn is token-exact, no
fork is spurious, no tool call is dropped silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_row_conforms(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli.main", "bench", "conformance", "--rows", "verifiers,openenv,mini-swe-agent", "--require-all",
         "--episodes", "2", "--max-turns", "2", "--max-tokens", "8", "--json", str(tmp_path / "report.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    rows = {(r["harness"], r["api"]): r for r in report["rows"]}
    assert set(rows) == {("chat SDK agent", "chat"), ("messages SDK agent", "messages"), ("responses SDK agent", "responses"),
                         ("verifiers SingleTurnEnv", "chat"), ("verifiers ToolEnv", "chat"), ("OpenEnv guess_number", "chat"),
                         ("mini-swe-agent", "chat")}
    assert report["missing"] == {} and report["conforms"]
    for row in rows.values():
        assert row["episodes"] == 2 and row["turns"] >= 2 and not row["failed_episodes"]
        assert (row["token_exact_pct"], row["spurious_forks"], row["silently_dropped"]) == (100.0, 0, 0)
    # the tool paths ran: harnesses that offer a tool got calls back (a turn reads as a call half the
    # time, so some row of these four does on the tiny model) and answered them (silently_dropped 0)
    tool_rows = [key for key in rows if "SDK" in key[0] or key[0] == "verifiers ToolEnv"]
    assert sum(rows[key]["tool_calls"] for key in tool_rows) > 0
    assert "| OpenEnv guess_number | chat | chatml | 2 |" in out.stdout  # the table, then the JSON
