"""The workspace: lockstep versions, member layout, every member builds, the kernel installs alone."""

from __future__ import annotations

import json
import os
import re
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


def test_every_member_is_ready_to_publish() -> None:
    """License, URLs, classifiers and a README that PyPI can show (its links absolute: a relative
    one is broken on the package's page)."""
    kernel_urls = _project(ROOT / "kernel")["urls"]
    licence = (ROOT / "LICENSE").read_text()
    assert licence.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in licence
    for member in _members():
        project = _project(member)
        where = member.relative_to(ROOT)
        assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"], where
        assert (member / "LICENSE").read_text() == licence, f"{where}/LICENSE differs from the repository's LICENSE"
        assert project["urls"] == kernel_urls and {"Homepage", "Repository", "Documentation", "Issues"} <= set(kernel_urls)
        assert "Programming Language :: Python :: 3.11" in project["classifiers"], where
        assert project["readme"] == "README.md" and project["description"], where
        readme = (member / "README.md").read_text()
        assert len(readme.splitlines()) >= 15, f"{where}/README.md: say what the package does, how to install it and how it plugs in"
        relative = [link for link in re.findall(r"\]\(([^)\s]+)\)", readme) if not link.startswith(("https://", "http://", "#"))]
        assert not relative, f"{where}/README.md links {relative}: make them absolute (they are broken on PyPI)"


def _dependencies(member: Path, *, extras: bool) -> set[str]:
    project = _project(member)
    specs = list(project.get("dependencies", []))
    if extras:
        specs += [d for deps in project.get("optional-dependencies", {}).values() for d in deps]
    return {re.split(r"[\s\[=<>!~;]", d, maxsplit=1)[0] for d in specs}


def test_members_depend_on_each_other_without_cycles() -> None:
    graph = {_project(m)["name"]: _dependencies(m, extras=True) for m in _members()}
    graph = {name: deps & graph.keys() for name, deps in graph.items()}
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"dependency cycle: {' -> '.join((*path, name))}"
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, (*path, name))
        state[name] = "done"

    for name in sorted(graph):
        visit(name, ())


def _installed_by(*requested: str) -> set[str]:
    """The members ``pip install <requested>`` brings (their runtime dependencies, transitively)."""
    runtime = {_project(m)["name"]: _dependencies(m, extras=False) for m in _members()}
    todo, seen = list(requested), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [d for d in runtime[name] if d in runtime]
    return seen


def _default_names(**overrides: str) -> set[tuple[str, str]]:
    """(registry kind, name) of every name the embedded default config refers to."""
    from miles.sections import CORE_SECTIONS, Choice

    names = set()
    for section, model in CORE_SECTIONS.items():
        values = model()
        for field_name, info in model.model_fields.items():
            value = overrides.get(f"{section}.{field_name}", getattr(values, field_name))
            kinds = [m.kind for m in info.metadata if isinstance(m, Choice)]
            for v in value if isinstance(value, list) else [value]:
                names |= {(kind, v) for kind in kinds if v is not None}
    return names


@pytest.mark.parametrize(("line", "backend", "architectures"), [
    (("miles-kernel", "miles-megatron", "miles-r3"), "megatron", ("LlamaForCausalLM", "Qwen3MoeForCausalLM")),
    (("miles-kernel", "miles-fsdp"), "fsdp", ("LlamaForCausalLM",)),
], ids=["kernel-megatron-r3", "kernel-fsdp"])
def test_an_install_line_with_a_train_backend_brings_what_the_default_run_needs(
        line: tuple[str, ...], backend: str, architectures: tuple[str, ...]) -> None:
    """What ``miles train`` needs on one machine comes with the backend: every name the default
    config refers to, the router every run starts, the model catalog (SmolLM2) and the bridges
    (megatron builds its model from one; R3 reads a MoE's layer map from one)."""
    from miles.install_hints import FIRST_PARTY, SERVICE_ROLES, providers_of

    installed = _installed_by(*line)
    needed = {p.distribution for kind, name in _default_names(**{"train.backend": backend})
              for p in providers_of(kind, name)}
    needed |= {p.distribution for name, role in SERVICE_ROLES.items() if role == "router" for p in providers_of("service", name)}
    needed |= {p.distribution for p in FIRST_PARTY if set(architectures) & set(p.architectures)}
    needed.add("miles-models")  # resolves model.name's default, smollm2-135m-instruct
    assert needed - installed == set(), f"pip install {' '.join(line)} lacks {sorted(needed - installed)}"


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

    # a bare kernel shows the defaults, and names the package of everything they need that is missing
    miles = str(venv / "bin" / "miles")
    out = subprocess.run([miles, "config", "show"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "name: smollm2-135m-instruct" in out.stdout, out.stderr
    for line in ("train.backend: unknown train backend 'fsdp': it comes with miles-fsdp, which is not installed "
                 "(pip install miles-fsdp); no train backend is installed",
                 "rollout.engine: unknown service 'embedded': it comes with miles-engine, which is not installed "
                 "(pip install miles-engine)",
                 "weights.transport: unknown weight transport 'shared_memory': it comes with miles-weights",
                 "algorithm.advantage: unknown advantage estimator 'grpo': it comes with miles-algorithms",
                 "needs a 'router' service and none is installed; it comes with miles-router, which is not installed"):
        assert line in out.stderr, out.stderr
    assert "miles_register" not in out.stderr
    out = subprocess.run([miles, "config", "show", "megatron.tensor_parallel=2"], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert ("megatron: unknown section; it comes with miles-megatron, which is not installed (pip install miles-megatron)"
            in out.stderr), out.stderr
    out = subprocess.run([miles, "models", "list"], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stderr) == (2, "error: `miles models list`: it comes with miles-models, which is not "
                                               "installed (pip install miles-models)\n")
