"""The `miles` command line: plugin listing and config show, through the real entry point."""

from __future__ import annotations

import argparse
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
    assert main(["config", "show", "run.mode=one_step_off", "algorithm.correction=tis", "rollout.temperature=0.5",
                 "--json"]) == 0
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


def test_help_lists_every_command_but_builds_only_the_named_ones_arguments() -> None:
    """`miles --help` must not run every command's add_arguments (they may import their package's
    heavy code; kernel/tests/test_import_isolation.py checks what the CLI imports); the command
    named on the line still gets its arguments."""
    from miles.cli.main import build_parser, named_command
    from miles_contracts import CommandSpec

    built: list[str] = []

    def command(name: str) -> CommandSpec:
        def add_arguments(parser: argparse.ArgumentParser) -> None:
            built.append(name)
            parser.add_argument("--flag")

        return CommandSpec(f"the {name} command", lambda args, ctx: 0, add_arguments=add_arguments)

    commands = {name: command(name) for name in ("plugins", "bench engine", "bench train")}
    assert named_command(["bench", "train", "--help"], commands) == "bench train"
    assert named_command(["--help"], commands) is None
    assert named_command(["bench"], commands) is None  # a group: argparse lists its commands
    parser = build_parser(commands, None)
    assert "plugins" in parser.format_help() and built == []
    build_parser(commands, "bench train").parse_args(["bench", "train", "--flag", "x"])
    assert built == ["bench train"]
    # through the real entry point: the named command's own arguments are there
    out = miles("models", "pull", "--help")
    assert out.returncode == 0 and "--force" in out.stdout


def test_an_unknown_key_or_section_gets_the_closest_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "run.stpes=2", "rollot.temperature=1", "run.zzzz=1"]) == 2
    err = capsys.readouterr().err
    assert "run.stpes: unknown key (did you mean run.steps? `miles config show` prints every key)" in err
    assert "rollot: unknown section; did you mean rollout? known sections: plugins, run," in err
    assert "run.zzzz: unknown key (check the spelling;" in err  # nothing close: no guess


@pytest.mark.parametrize("field", ["disable", "enable"])
def test_a_misspelled_plugin_in_the_config_stops_the_command(field: str, capsys: pytest.CaptureFixture[str]) -> None:
    # plugins.disable: [lamma] used to be accepted, leaving llama on
    assert main(["config", "show", f"plugins.{field}=[lamma]"]) == 2
    err = capsys.readouterr().err
    assert f"plugins.{field} names plugin(s) that are not installed: lamma (did you mean 'llama'?); installed:" in err


def test_an_unknown_model_name_fails_before_the_run_folder_is_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    assert main(["train", "model.name=smollm2-135m", f"run.output_dir={runs}", "run.name=typo"]) == 2
    err = capsys.readouterr().err
    assert "model 'smollm2-135m' is not a local folder" in err
    assert "Did you mean 'smollm2-135m-instruct'?" in err
    assert not runs.exists()  # not even a folder holding only config.yaml
