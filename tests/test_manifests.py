"""Every workspace member's manifest declares exactly what its code imports.

For each member (the ``[tool.uv.workspace] members`` globs of the root ``pyproject.toml``) every
``.py`` under ``src/`` is parsed with :mod:`ast` and the top-level names of its absolute imports are
collected, wherever they are (module level, inside functions, in ``try`` blocks), and also
``importlib.import_module("literal")``. An import name is mapped to its distribution through the
installed environment (``importlib.metadata.packages_distributions()``); a workspace member maps
through its ``[tool.hatch.build.targets.wheel] packages``. The standard library and the member's own
package are ignored. Then, per member:

* **Undeclared**: a distribution imported at run time that no dependency list of the member names.
  Two kinds of import are not required to be declared: those under ``if TYPE_CHECKING:`` (they
  never run; a type checker reads them, a user of the package need not install them), and those in
  a ``try`` whose handler catches ``ImportError`` (the code copes without the module).
* **Through workspace members**: depending on a workspace member brings what that member depends
  on at run time, transitively (``miles-kernel`` brings ``miles-contracts``, ``pydantic``,
  ``httpx`` ...): members are released together and pin each other ``==``, so a member's
  dependencies are part of what it provides. A third-party distribution's own dependencies are not
  (``certifi`` comes with ``httpx`` today, and may not tomorrow).
* **Extras**: a dependency in any ``[project.optional-dependencies]`` extra counts as declared, for
  any import of it. Which code paths an extra unlocks is not something this test can tell (a
  module importing an extra's distribution at its top level may itself be imported only by the
  feature the extra is for); the packages import extras lazily and name the extra when it is
  missing.
* **Unused**: a dependency (runtime or extra) whose distribution nothing in ``src/`` imports at run
  time (an import under ``TYPE_CHECKING`` is no use at run time), unless :data:`NOT_IMPORTED` lists
  it with its reason (a plugin found by entry point, a library another library uses for us).
* A module started in a child process, ``[..., "-m", "module", ...]`` as list or tuple literals,
  counts as an import (``python -m miles_engine``).

Undeclared imports that are right anyway are listed in :data:`UNDECLARED_OK`, with their reason.

Members are matched to distributions by normalised name (PEP 503), so ``PyYAML`` is ``pyyaml``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Declared dependencies that no import in src/ names, and why each is still right.
NOT_IMPORTED: dict[tuple[str, str], str] = {
    # agents run under the agentic generator and its session server, found by entry point
    **{(example, "miles-tito"): "the agentic generator and session server the agent runs under (rollout.generator: agentic)"
       for example in ("miles-example-delegating-agent", "miles-example-solver-verifier")},
    # plugins found by entry point at run time, not imported
    ("miles-fsdp", "miles-models"): "resolves catalogued model names (model.name's default) via miles_resolve_model",
    ("miles-megatron", "miles-models"): "resolves catalogued model names (model.name's default) via miles_resolve_model",
    ("miles-fsdp", "miles-weights"): "the weight transports (weights.transport, default shared_memory) its ranks push through",
    ("miles-megatron", "miles-weights"): "the weight transports (weights.transport, default shared_memory) its ranks push through",
    # a train backend brings the rest of what `miles train` runs on one machine (docs/design/packaging.md)
    **{(b, "miles-router"): "the router every run starts in front of its engines, a service started by entry point"
       for b in ("miles-fsdp", "miles-megatron")},
    **{(b, d): "first-party model plugin: bridges, chat families and MoE layer maps, claimed through miles_model_bridge"
       for b in ("miles-fsdp", "miles-megatron") for d in ("miles-model-llama", "miles-model-qwen3")},
    **{("miles-longtail", d): "miles bench async trains with it (backend, router, session server, transport)"
       for d in ("miles-fsdp", "miles-router", "miles-tito", "miles-weights")},
    # libraries other code uses on the package's behalf
    ("miles-engine", "numpy"): "Tensor.numpy() (engine.py, weights.py) needs numpy, which torch does not require",
    ("miles-models", "gguf"): "transformers reads the catalogue's GGUF files through it (from_pretrained(gguf_file=))",
    ("miles-models", "accelerate"): "transformers requires it to load a GGUF file",
    ("miles-models", "safetensors"): "the cache's format: save_pretrained writes safetensors, every backend reads them",
    ("miles-tito", "uvloop"): "uvicorn's event loop when installed (loop='auto')",
    ("miles-tito", "httptools"): "uvicorn's HTTP parser when installed (http='auto')",
    ("miles-r3", "megatron-core"): "extra megatron: replays routing on megatron-core's TopKRouter, found in sys.modules",
    # one module, three builds: each extra installs one (cpu, cuda12, cuda13); miles_mooncake drives
    # the ``mooncake`` module through miles_contracts.wire.mooncake, which imports it
    **{("miles-mooncake", d): "a build of the mooncake module (used through miles_contracts.wire.mooncake)"
       for d in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")},
}

# Imports (by distribution, or by module when nothing installed provides it) a member need not
# declare, and why.
UNDECLARED_OK: dict[tuple[str, str], str] = {
    # the kernel and the contracts install without torch (tests/test_workspace.py); these imports
    # run only on a train backend's tensors or models, in a process the backend's package set up
    ("miles-kernel", "torch"): "advantages.py, trainer/collectives.py and trainer/safe_checkpoint.py run on a "
                               "backend's tensors and checkpoints, in its ranks",
    ("miles-contracts", "torch"): "batch helpers and conformance suites work on tensors a plugin made",
    ("miles-contracts", "transformers"): "conformance suites for train backends and bridges, run by those packages",
    ("miles-contracts", "megatron-core"): "testing/megatron.py, run by miles-megatron's tests",
    # run by another engine's own Python (``miles bench engine``), never in a Miles environment
    ("miles-engine", "sglang"): "bench/sglang_runner.py runs in SGLang's environment",
    ("miles-engine", "vllm"): "bench/vllm_runner.py runs in vLLM's environment",
    # torch's Linux wheels depend on triton (uv.lock holds it through torch); invariant_triton.py is
    # imported only when an invariant op meets a CUDA tensor, and invariant.check_supported names the
    # missing package before that (docs/design/true-on-policy.md, "Where the shared ops live")
    ("miles-engine", "triton"): "invariant_triton.py, the true-on-policy GPU kernels, comes with CUDA torch",
    ("miles-sglang", "sglang"): "python -m sglang.launch_server, by SGLang's own Python (sglang.python) in its environment",
}

TYPE_CHECKING_NAMES = frozenset({"TYPE_CHECKING", "typing.TYPE_CHECKING"})
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    assert match, f"cannot read a distribution name from requirement {spec!r}"
    return normalise(match.group(1))


@dataclass(frozen=True)
class Member:
    path: Path
    name: str  # normalised distribution name
    packages: tuple[str, ...]  # import names it provides
    runtime: frozenset[str]  # normalised names of [project] dependencies
    extras: dict[str, frozenset[str]]

    @property
    def declared(self) -> frozenset[str]:
        """Every distribution a dependency list names (runtime or an extra)."""
        return self.runtime.union(*self.extras.values())


def provided(member: Member, by_name: dict[str, Member]) -> frozenset[str]:
    """What ``member``'s dependency lists name, with the runtime dependencies of the workspace
    members among them, transitively."""
    seen: set[str] = set()
    todo = list(member.declared)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in by_name:
            todo.extend(by_name[name].runtime)
    return frozenset(seen)


def members() -> list[Member]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = []
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        for path in sorted(ROOT.glob(pattern)):
            if not (path / "pyproject.toml").is_file():
                continue
            data = tomllib.loads((path / "pyproject.toml").read_text())
            project = data["project"]
            wheel = data.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
            packages = tuple(Path(p).name for p in wheel.get("packages", []))
            assert packages, f"{path.relative_to(ROOT)}: no [tool.hatch.build.targets.wheel] packages"
            found.append(Member(
                path, normalise(project["name"]), packages,
                frozenset(requirement_name(d) for d in project.get("dependencies", [])),
                {extra: frozenset(requirement_name(d) for d in deps)
                 for extra, deps in project.get("optional-dependencies", {}).items()},
            ))
    return found


@cache
def distributions_of() -> dict[str, frozenset[str]]:
    """Import name -> normalised names of the distributions that provide it."""
    mapping = {name: frozenset(normalise(d) for d in dists)
               for name, dists in importlib.metadata.packages_distributions().items()}
    for member in members():  # the workspace's own, whatever the editable install shows
        for package in member.packages:
            mapping[package] = frozenset({member.name})
    return mapping


# ----------------------------------------------------------------------------------- imports


@dataclass(frozen=True)
class Import:
    module: str  # top-level name
    where: str  # file:line
    typing_only: bool  # under ``if TYPE_CHECKING:``
    optional: bool  # in a ``try`` that catches ImportError


@dataclass
class _Scope:
    typing_only: bool = False
    optional: bool = False


class _Collector(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.scope = _Scope()
        self.found: list[Import] = []

    def _add(self, module: str, node: ast.AST) -> None:
        top = module.split(".")[0]
        if top and top != "__future__":
            self.found.append(Import(top, f"{self.where}:{getattr(node, 'lineno', 0)}", self.scope.typing_only,
                                     self.scope.optional))

    def _within(self, nodes: list[ast.stmt], **changes: bool) -> None:
        saved = self.scope
        self.scope = _Scope(**{**saved.__dict__, **changes})
        for node in nodes:
            self.visit(node)
        self.scope = saved

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module, node)

    def _argv(self, node: ast.List | ast.Tuple) -> None:
        items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        for flag, module in zip(items, items[1:], strict=False):
            if flag == "-m" and isinstance(module, str):
                self._add(module, node)
        self.generic_visit(node)

    visit_List = visit_Tuple = _argv

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node)
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        if ast.unparse(node.test) in TYPE_CHECKING_NAMES:
            self._within(node.body, typing_only=True)
            self._within(node.orelse)
        else:
            self._within(node.body)
            self._within(node.orelse)

    def visit_Try(self, node: ast.Try) -> None:
        caught = set()
        for handler in node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {"" if k is None else ast.unparse(k).split(".")[-1] for k in kinds}
        self._within(node.body, optional=self.scope.optional or bool(caught & IMPORT_ERRORS))
        for handler in node.handlers:
            self._within(handler.body)
        self._within(node.orelse)
        self._within(node.finalbody)

    visit_TryStar = visit_Try


def imports_of(member: Member) -> Iterator[Import]:
    for path in sorted((member.path / "src").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        collector = _Collector(where)
        collector.visit(ast.parse(path.read_text(), filename=where))
        yield from collector.found


# ----------------------------------------------------------------------------------- the check


@dataclass
class Report:
    undeclared: dict[str, list[str]] = field(default_factory=dict)  # distribution (or module) -> where
    unused: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)  # distributions imported at run time

    def lines(self) -> list[str]:
        out = [f"imports {d} (not declared) at {', '.join(w[:3])}" for d, w in sorted(self.undeclared.items())]
        out += [f"declares {d} but never imports it" for d in self.unused]
        return out


def check_member(member: Member) -> Report:
    report = Report()
    stdlib = sys.stdlib_module_names
    mapping = distributions_of()
    available = provided(member, {m.name: m for m in MEMBERS})
    used = report.used
    for imp in imports_of(member):
        if imp.module in stdlib or imp.module in member.packages:
            continue
        dists = mapping.get(imp.module)
        if dists is None:  # nothing installed provides it
            if not (imp.typing_only or imp.optional or (member.name, imp.module) in UNDECLARED_OK):
                report.undeclared.setdefault(f"module {imp.module!r} (no installed distribution)", []).append(imp.where)
            continue
        if imp.typing_only:
            continue
        used |= dists
        if imp.optional or dists & available or any((member.name, d) in UNDECLARED_OK for d in dists):
            continue
        report.undeclared.setdefault("/".join(sorted(dists)), []).append(imp.where)
    report.unused = sorted(d for d in member.declared - used if (member.name, d) not in NOT_IMPORTED)
    return report


MEMBERS = members()


def test_the_workspace_has_members() -> None:
    names = {m.name for m in MEMBERS}
    assert {"miles-kernel", "miles-contracts", "miles-ray"} <= names and len(names) == len(MEMBERS)


def test_allow_lists_are_current() -> None:
    by_name = {m.name: m for m in MEMBERS}
    stale = [key for key in NOT_IMPORTED if key[0] not in by_name or key[1] not in by_name[key[0]].declared]
    assert not stale, f"NOT_IMPORTED lists dependencies no manifest declares: {stale}"
    used = {m.name: check_member(m).used for m in MEMBERS}
    imported_now = [key for key in NOT_IMPORTED if key[1] in used[key[0]]]
    assert not imported_now, f"NOT_IMPORTED lists dependencies that are imported now: {imported_now}"
    imported = {m.name: {d for i in imports_of(m) if not i.typing_only
                         for d in distributions_of().get(i.module, {i.module})} for m in MEMBERS}
    stale = [key for key in UNDECLARED_OK if key[0] not in by_name or key[1] not in imported[key[0]]]
    assert not stale, f"UNDECLARED_OK lists imports no member makes: {stale}"
    declared = [key for key in UNDECLARED_OK if key[0] in by_name and key[1] in by_name[key[0]].declared]
    assert not declared, f"UNDECLARED_OK lists imports their manifests declare now: {declared}"


@pytest.mark.parametrize("member", MEMBERS, ids=[m.name for m in MEMBERS])
def test_manifest_declares_exactly_what_the_package_imports(member: Member) -> None:
    problems = check_member(member).lines()
    assert not problems, (f"{member.path.relative_to(ROOT)}/pyproject.toml:\n  - " + "\n  - ".join(problems))
