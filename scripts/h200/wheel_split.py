"""Split a wheelhouse by what needs it (here, before device calls; see README.md in this folder).

    python3 scripts/h200/wheel_split.py WHEELS --move-to DIR [--keep NAME]... ROOT [ROOT ...]

Moves to DIR the wheels that only ROOT packages need: the requirement closure of the ROOTs (their
``Requires-Dist`` for Python 3.12 on Linux, requested extras followed) less the closure of every
other wheel in WHEELS. ``.whl`` (one call's 64 MiB) thus keeps what the trainer, engines and benches
import, and the agent harnesses' dependencies (litellm alone is 42 MB) travel in calls of their own.
"""

from __future__ import annotations

import argparse
import re
import shutil
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

DEVICE = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[tuple[str, frozenset[str], str | None]]:
    """(name, extras it asks for, the extra of ours it belongs to or None) per ``Requires-Dist``."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    found = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        extra = next((e for e in re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(req.marker or ""))), None)
        if req.marker is not None and not req.marker.evaluate({**DEVICE, "extra": extra or ""}):
            continue
        found.append((canonical(req.name), frozenset(map(canonical, req.extras)), extra))
    return found


def closure(wheels: dict[str, Path], roots: list[tuple[str, frozenset[str]]]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    visited: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in visited or name not in wheels:
            continue
        visited.add((name, extras))
        seen.add(name)
        for dep, dep_extras, extra in requirements(wheels[name]):
            if extra is None or canonical(extra) in extras:
                todo.append((dep, dep_extras))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path)
    parser.add_argument("--move-to", type=Path, required=True)
    parser.add_argument("--keep", action="append", default=[], help="packages that stay with their closure (what a wheel "
                        "outside WHEELS needs, e.g. datasets for .trl's TRL)")
    parser.add_argument("roots", nargs="+", help="package names, e.g. mini-swe-agent or miles-sandbox[swe]")
    args = parser.parse_args()
    wheels = {canonical(p.name.split("-")[0]): p for p in args.wheels.glob("*.whl")}
    roots = [(canonical(r.name), frozenset(map(canonical, r.extras))) for r in map(Requirement, args.roots)]
    needed_by_roots = closure(wheels, roots)
    # every wheel outside that closure, extras not followed (optional by definition: an extra that
    # needs a ROOT is what this split takes to a call of its own)
    kept = [(canonical(name), frozenset()) for name in args.keep]
    needed_elsewhere = closure(wheels, [(name, frozenset()) for name in wheels if name not in needed_by_roots] + kept)
    args.move_to.mkdir(parents=True, exist_ok=True)
    moved = sorted(needed_by_roots - needed_elsewhere)
    for name in moved:
        shutil.move(str(wheels[name]), args.move_to / wheels[name].name)
    print(f"moved {len(moved)} wheels to {args.move_to}: {' '.join(moved)}")


if __name__ == "__main__":
    main()
