"""``miles train --resume RUN_DIR`` takes a setting that starts a program or receives the run's
token (a field marked ``Privileged`` by the section that declares it) from the run folder only
when the command line says so.

The CLI tests run the real ``miles`` in a child process on a crafted folder whose
``sglang.python`` names a script: refused before anything runs; resumed (the script runs) once
the user repeats the setting, as the error suggests, or passes ``--trust-run-config``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from miles.config import apply_overrides, build_config
from miles.kernel import Kernel
from miles.loop.folder_config import privileged_fields, settings_from_folder
from miles.sections import CORE_SECTIONS

ROOT = Path(__file__).resolve().parents[2]

PRIVILEGED = {"sglang.python", "sglang.env", "sglang.sglang_args", "tito.session_server_url", "ray.address",
              "mlflow.tracking_uri"}
"""Every setting of the workspace's sections that decides what code runs or where the run's
secrets go (docs/design/security.md, "Run folders and checkpoints", lists them with the reasons)."""


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    return Kernel.load()


def test_the_settings_that_start_programs_or_receive_secrets_are_marked_where_declared(kernel: Kernel) -> None:
    models = {**CORE_SECTIONS, **{e.name: e.obj.model for e in kernel.config_sections().entries()}}
    marked = {f"{section}.{name}" for section, model in models.items() for name in privileged_fields(model)}
    assert marked == PRIVILEGED


def test_a_folder_value_counts_only_if_it_is_not_the_default_nor_given_whole(kernel: Kernel) -> None:
    folder = {"rollout": {"engine": "sglang"}, "sglang": {"python": "/x/python", "env": {"A": "1"}, "sglang_args": []}}

    def taken(*overrides: str) -> dict:
        data = yaml.safe_load(yaml.safe_dump(folder))
        assert not apply_overrides(data, overrides)
        return {s.key: s.value for s in settings_from_folder(build_config(data, kernel=kernel, check_names=False), overrides)}

    assert taken() == {"sglang.python": "/x/python", "sglang.env": {"A": "1"}}  # sglang_args is the default
    assert taken("sglang.python=/x/python") == {"sglang.env": {"A": "1"}}
    assert taken("sglang={python: /y}") == {}  # the whole section given
    assert taken("sglang.env.B=b") == {"sglang.python": "/x/python", "sglang.env": {"A": "1", "B": "b"}}  # A is the folder's


def test_the_suggested_overrides_give_back_the_folder_s_values(kernel: Kernel) -> None:
    from miles.cli.section_args import config_override

    values = {"sglang.python": "/opt/my env/bin/python", "sglang.env": {"FLAG": "true", "N": "08"},
              "sglang.sglang_args": ["--trust-remote-code", "--x=1: 2"]}
    data: dict = {"rollout": {"engine": "sglang"}}
    assert not apply_overrides(data, [config_override(key, value) for key, value in values.items()])
    section = build_config(data, kernel=kernel, check_names=False).extra["sglang"]
    assert {f"sglang.{k}": getattr(section, k) for k in ("python", "env", "sglang_args")} == values


def _crafted_run(tmp_path: Path, model: Path) -> tuple[Path, Path, Path]:
    """A run folder whose config starts ``script`` as SGLang's Python; the script leaves ``marker``
    and exits 3 (it is not SGLang, so an accepted resume fails as soon as the engine is started)."""
    marker = tmp_path / "script-ran"
    script = tmp_path / "not-python.sh"
    script.write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 3\n")
    script.chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    config = {"model": {"name": str(model), "device": "cpu"}, "rollout": {"engine": "sglang"},
              "sglang": {"python": str(script), "env": {"SGLANG_EXTRA": "1"}}, "executor": {"startup_timeout": 60}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run, script, marker


def _miles(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)


def _engine_started(out: subprocess.CompletedProcess[str]) -> bool:
    """The run started the folder's program as the engine (which then exited, being no SGLang)."""
    return out.returncode != 0 and "exited with code 3 during start-up" in out.stderr


@pytest.mark.slow
def test_resume_refuses_a_folder_that_names_a_program_then_takes_it_when_repeated(tmp_path: Path,
                                                                                   tiny_dense: Path) -> None:
    run, script, marker = _crafted_run(tmp_path, tiny_dense)
    written = (run / "config.yaml").read_text()
    refused = _miles("train", "--resume", str(run), "run.steps=1")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"sglang.python: {script}" in refused.stderr and "sglang.env: {SGLANG_EXTRA: '1'}" in refused.stderr
    assert "--trust-run-config" in refused.stderr
    assert not marker.exists()
    assert (run / "config.yaml").read_text() == written  # nothing taken, nothing rewritten

    [suggested] = [line.strip() for line in refused.stderr.splitlines() if line.strip().startswith("miles train")]
    accepted = _miles(*shlex.split(suggested)[1:])  # the command line the error gives, as a user would paste it
    assert _engine_started(accepted), accepted.stdout + accepted.stderr
    assert marker.exists()


@pytest.mark.slow
def test_trust_run_config_takes_the_folder_s_whole_config(tmp_path: Path, tiny_dense: Path) -> None:
    run, _script, marker = _crafted_run(tmp_path, tiny_dense)
    accepted = _miles("train", "--resume", str(run), "run.steps=1", "--trust-run-config")
    assert _engine_started(accepted), accepted.stdout + accepted.stderr
    assert marker.exists()
