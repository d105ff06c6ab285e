"""The `miles` command line: plugin listing and config show, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def miles(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "miles.cli.main", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})},
    )


def test_plugins_lists_builtins_and_model_plugins() -> None:
    out = miles("plugins", "--json")
    assert out.returncode == 0, out.stderr
    infos = {p["name"]: p for p in json.loads(out.stdout)}
    assert infos["core"]["distribution"] == "miles-kernel"
    assert infos["core"]["version"] == "0.1.0"
    assert "miles_register_commands" in infos["core"]["hooks"]
    assert infos["llama"]["distribution"] == "miles-model-llama"


def test_plugins_table_shows_blocked() -> None:
    out = miles("plugins", env={"MILES_DISABLE_PLUGINS": "llama"})
    assert out.returncode == 0, out.stderr
    line = next(row for row in out.stdout.splitlines() if row.startswith("llama "))
    assert "miles-model-llama" in line and "blocked" in line


def test_config_show_reports_all_errors_and_exits_nonzero(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  temprature: 1\nrun:\n  steps: 0\n")
    out = miles("config", "show", str(path))
    assert out.returncode == 2
    assert "error(s)" in out.stderr
    assert "rollout.temprature: unknown key" in out.stderr
    assert "run.steps: Input should be greater than or equal to 1" in out.stderr


def test_help_lists_registered_commands() -> None:
    out = miles("--help")
    assert out.returncode == 0
    for command in ("plugins", "config", "models"):
        assert command in out.stdout
