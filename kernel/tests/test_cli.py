"""The `miles` command line: plugin listing and config show, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from miles.cli.config_args import split_config_args
from miles.cli.main import main
from miles.errors import MilesError


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


@pytest.mark.parametrize(("items", "expected"), [
    ([], (None, [])),
    (["c.yaml"], (Path("c.yaml"), [])),
    (["run.mode=sync"], (None, ["run.mode=sync"])),
    (["c.yaml", "run.steps=2", "rollout.stop=[a=b]"], (Path("c.yaml"), ["run.steps=2", "rollout.stop=[a=b]"])),
])
def test_config_arguments_split_into_file_and_overrides(items: list[str], expected: tuple) -> None:
    assert split_config_args(items) == expected


@pytest.mark.parametrize("items", [["run.steps=2", "c.yaml"], ["c.yaml", "d.yaml"], ["c.yaml", "run.steps", "2"]])
def test_a_second_argument_without_equals_is_refused(items: list[str]) -> None:
    with pytest.raises(MilesError, match="expected section.key=value overrides"):
        split_config_args(items)


def test_config_show_and_train_read_the_same_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "run.mode=one_step_off", "rollout.temperature=0.5", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["run"]["mode"] == "one_step_off" and cfg["rollout"]["temperature"] == 0.5
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  steps: 3\n")
    assert main(["config", "show", str(path), "rollout.temperature=0.5", "--json"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["run"]["steps"] == 3 and cfg["rollout"]["temperature"] == 0.5
    # `miles train` reads its first argument as an override too: the typo is reported by the
    # config check (before anything starts), not as a missing file
    assert main(["train", "run.stepz=2"]) == 2
    err = capsys.readouterr().err
    assert "run.stepz: unknown key" in err and "cannot read config file" not in err
