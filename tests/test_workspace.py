"""The workspace: lockstep versions, member layout, every member builds, the kernel installs alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _members() -> list[Path]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = []
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        out += sorted(p for p in ROOT.glob(pattern) if (p / "pyproject.toml").is_file())
    return out


def _project(member: Path) -> dict:
    return tomllib.loads((member / "pyproject.toml").read_text())["project"]


def test_versions_move_in_lockstep() -> None:
    members = {_project(m)["name"]: _project(m) for m in _members()}
    version = members["miles-kernel"]["version"]
    assert {p["version"] for p in members.values()} == {version}
    for name, project in members.items():
        for dep in project.get("dependencies", []):
            dep_name = dep.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip()
            if dep_name in members:
                assert dep.endswith(f"=={version}"), f"{name} must pin {dep_name}=={version}, has {dep!r}"


def test_every_member_has_src_tests_readme_and_plugin_entry_point() -> None:
    for member in _members():
        project = _project(member)
        assert (member / "README.md").is_file(), member
        assert (member / "tests").is_dir(), member
        packages = [p for p in (member / "src").iterdir() if p.is_dir() and not p.name.startswith(".")]
        assert len(packages) == 1, f"{member}/src must hold exactly one import package"
        if project["name"] != "miles-contracts":
            assert project.get("entry-points", {}).get("miles"), f"{member} registers no plugin"


@pytest.mark.slow
def test_build_all_members_and_install_the_kernel_alone(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    dist = tmp_path / "dist"
    subprocess.run([uv, "build", "--all-packages", "--wheel", "-q", "-o", str(dist)], cwd=ROOT, check=True)
    built = {w.name.split("-")[0].replace("_", "-") for w in dist.glob("*.whl")}
    assert built == {_project(m)["name"] for m in _members()}

    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(python), "--find-links", str(dist), "miles-kernel"],
        check=True, env=env,
    )
    installed = subprocess.run([uv, "pip", "list", "--python", str(python), "--format", "json"],
                               capture_output=True, text=True, check=True, env=env)
    names = {p["name"] for p in json.loads(installed.stdout)}
    assert {n for n in names if n.startswith("miles")} == {"miles-kernel", "miles-contracts"}
    assert "torch" not in names

    out = subprocess.run([str(venv / "bin" / "miles"), "plugins", "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    plugins = json.loads(out.stdout)
    assert {p["distribution"] for p in plugins} == {"miles-kernel"}
    assert "core" in {p["name"] for p in plugins}
