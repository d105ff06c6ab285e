"""The seams between kernel and plugins keep their 0.2 shape (docs/design/plugin-kernel.md).

Checked on the source, with ``ast``: no plugin builds a kernel of its own (``Kernel.load`` is for
the entry points of a run's processes, which hand the kernel down in a ``RunContext``); the
kernel reads no capability off a registered object (capabilities are spec fields; the one-release
adapters of :mod:`miles.legacy` are the exception); the loop package has no import cycle, and it
holds its backend, transport and executor by their types, never as ``Any``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = [*ROOT.glob("packages/*/src"), *ROOT.glob("plugins/*/src"), *ROOT.glob("examples/*/src")]
KERNEL = ROOT / "kernel" / "src" / "miles"


def _python_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_no_plugin_loads_a_kernel_of_its_own() -> None:
    offenders = []
    for path in _python_files(*PLUGIN_SOURCES):
        for call in _calls(ast.parse(path.read_text())):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name) \
                    and func.value.id == "Kernel":
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not offenders, f"plugins must use the RunContext they are given, not Kernel.load(): {offenders}"


def _probes(path: Path) -> list[str]:
    """``getattr(obj, "name", default)`` and ``hasattr(obj, "name")`` calls: a capability probe
    when ``obj`` is something a plugin registered."""
    found = []
    for call in _calls(ast.parse(path.read_text())):
        name = call.func.id if isinstance(call.func, ast.Name) else None
        literal = len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str)
        if (name == "getattr" and len(call.args) == 3 and literal) or (name == "hasattr" and literal):
            found.append(f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)}")
    return found


# the CLI's own argparse namespaces, and what a Hugging Face tokenizer returns: nobody's plugin
NOT_CAPABILITIES = ("getattr(args, ", "hasattr(ids, 'keys')")


def test_the_kernel_probes_no_capability_off_a_registered_object() -> None:
    probes = [probe for path in _python_files(KERNEL) if path.name != "legacy.py" for probe in _probes(path)
              if not any(allowed in probe for allowed in NOT_CAPABILITIES)]
    assert not probes, f"declare these as spec fields (miles_contracts.specs) instead: {probes}"


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (imports under ``if TYPE_CHECKING:`` left out)."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
               for stmt in block.body for node in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_loop_package_has_no_import_cycle() -> None:
    loop = KERNEL / "loop"
    modules = {"miles." + ".".join(p.relative_to(KERNEL.parent).with_suffix("").parts[1:]).removesuffix(".__init__"): p
               for p in _python_files(loop)}
    graph = {name: {m for m in _runtime_imports(path) if m in modules and m != name} for name, path in modules.items()}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*trail, start]
                if nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = [cycle for name in graph if (cycle := cycle_from(name))]
    assert not cycles, f"import cycles in miles.loop: {cycles[0]}"


def test_the_loop_holds_backend_transport_and_executor_by_type() -> None:
    untyped = []
    for path in _python_files(KERNEL / "loop"):
        for node in ast.walk(ast.parse(path.read_text())):
            target, annotation = None, None
            if isinstance(node, ast.AnnAssign):
                target, annotation = ast.unparse(node.target), node.annotation
            elif isinstance(node, ast.arg) and node.annotation is not None:
                target, annotation = node.arg, node.annotation
            if target is None or annotation is None:
                continue
            if any(word in target.lower() for word in ("backend", "transport", "executor", "trainer")) \
                    and "Any" in ast.unparse(annotation):
                untyped.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}: {ast.unparse(annotation)}")
    assert not untyped, f"type these (TrainBackend, WeightTransport, Executor, TrainerGroup): {untyped}"
