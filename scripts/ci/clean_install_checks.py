"""Checks of scripts/ci/clean_install.sh, run by the clean environment's Python (standard library only).

``installed DIST --expect NAME...``: the miles-* distributions installed are exactly the expected
ones, and each is the wheel of that name in DIST, file by file (the hashes of its RECORD): with
``--find-links`` and a package index together, an installer may take a same-named package from the
index, and then the test would pass on someone else's code.

``run RUN_DIR --steps N [--metric NAME]... [--checkpoint]``: a finished run logged steps 1..N in
``metrics.jsonl``, each with every metric asked for, and wrote its final checkpoint when asked.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
import zipfile
from importlib import metadata
from pathlib import Path


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _record(text: str) -> set[tuple[str, str]]:
    """(path, hash) of every file of a RECORD but the .dist-info's own (installers add to those)."""
    return {(row[0], row[1]) for row in csv.reader(io.StringIO(text))
            if row and row[1] and ".dist-info/" not in row[0]}


def check_installed(dist_dir: Path, expected: list[str]) -> list[str]:
    wheels = {normalise(w.name.split("-")[0]): w for w in dist_dir.glob("*.whl")}
    installed = {normalise(d.metadata["Name"]): d for d in metadata.distributions()
                 if normalise(d.metadata["Name"]).startswith("miles-")}
    problems = []
    if set(installed) != {normalise(n) for n in expected}:
        problems.append(f"miles packages installed: {sorted(installed)}; expected: {sorted(map(normalise, expected))}")
    for name, dist in sorted(installed.items()):
        wheel = wheels.get(name)
        if wheel is None:
            problems.append(f"{name} is installed but no wheel of it was built")
            continue
        with zipfile.ZipFile(wheel) as archive:
            record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
            built = _record(archive.read(record).decode())
        files = _record(dist.read_text("RECORD") or "")
        # the installer adds files of its own (console scripts under bin/), never changes the wheel's
        if not built or not built <= files or any(not path.startswith("../") for path, _ in files - built):
            problems.append(f"{name} {dist.version} differs from {wheel.name}: it came from somewhere else")
    return problems


def check_run(run_dir: Path, steps: int, metrics: list[str], checkpoint: bool) -> list[str]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return [f"{path} is missing: the run did not log a step"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    problems = []
    if [r.get("step") for r in rows] != list(range(1, steps + 1)):
        problems.append(f"{path}: steps {[r.get('step') for r in rows]}, expected 1..{steps}")
    for row in rows:
        for name in metrics:
            value = row.get(name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"{path}: step {row.get('step')} has {name} = {value!r}")
    if checkpoint and not (run_dir / "checkpoints" / f"step_{steps:06d}" / "miles-state.json").is_file():
        problems.append(f"{run_dir}: no complete checkpoint of step {steps}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    installed = sub.add_parser("installed")
    installed.add_argument("dist", type=Path)
    installed.add_argument("--expect", nargs="+", required=True)
    run = sub.add_parser("run")
    run.add_argument("run_dir", type=Path)
    run.add_argument("--steps", type=int, required=True)
    run.add_argument("--metric", action="append", default=[])
    run.add_argument("--checkpoint", action="store_true")
    args = parser.parse_args()
    if args.check == "installed":
        problems = check_installed(args.dist, args.expect)
    else:
        problems = check_run(args.run_dir, args.steps, args.metric, args.checkpoint)
    for problem in problems:
        print(f"clean install: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
