"""Start-up cost of the ``miles`` command line: wall and CPU seconds of the commands that only read
plugins and config, against the interpreter alone and against an older commit, measured in one
run (docs/benchmarks/cli.md).

    uv run python scripts/cli_bench.py --baseline-ref a811b16 --repeats 5 --out docs/benchmarks/cli.json

Cases: ``miles --help``, ``miles config show`` and a config error (``run.stpes=2``: an unknown
key). Each variant runs the same ``python -m miles.cli.main`` with this venv's interpreter and
installed distributions (so the same entry points); only ``PYTHONPATH`` differs: this checkout's
sources, or those of ``--baseline-ref`` unpacked with ``git archive`` into a temporary folder (the
repository is not touched). ``python -c pass`` is the floor any command pays. Runs alternate
between variants, so load from other jobs on the machine falls on each alike; CPU seconds
(user + sys of the child) are the steadier number on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES: dict[str, list[str]] = {
    "help": ["--help"],
    "config_show": ["config", "show"],
    "config_error": ["config", "show", "run.stpes=2"],
}


def source_path(root: Path) -> str:
    """``PYTHONPATH`` putting every package's ``src`` folder of the checkout at ``root`` first."""
    folders = sorted(root.glob("*/src")) + sorted(root.glob("*/*/src"))
    return os.pathsep.join(str(f) for f in folders)


def unpack(ref: str, into: Path) -> Path:
    """The tree of commit ``ref`` written under ``into`` (no worktree, no checkout)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", ref],
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as tar_file:
        tar_file.write(archive)
        tar_file.seek(0)
        with tarfile.open(fileobj=tar_file) as tar:
            tar.extractall(into, filter="data")
    return into


def timed(argv: Sequence[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + sys) seconds of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


Results = dict[str, dict[str, dict[str, float]]]
"""variant -> ``wall_s`` / ``cpu_s`` -> median, min, max."""


def measure(variants: dict[str, tuple[list[str], dict[str, str]]], repeats: int) -> Results:
    """Every variant once as a warm-up (page cache, .pyc files), then ``repeats`` rounds, each
    running every variant once."""
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    for argv, env in variants.values():
        timed(argv, env)
    for _ in range(repeats):
        for name, (argv, env) in variants.items():
            wall, cpu = timed(argv, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    return {name: {"wall_s": summary(walls[name]), "cpu_s": summary(cpus[name])} for name in variants}


def ratio(results: Results, top: str, bottom: str, metric: str) -> float:
    return round(results[top][metric]["median"] / results[bottom][metric]["median"], 2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after the warm-up (at least 3)")
    parser.add_argument("--baseline-ref", help="also measure this commit's sources (e.g. the commit before a change)")
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: the report gives a median and a spread")

    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MILES_DISABLE_PLUGINS")}
    with tempfile.TemporaryDirectory(prefix="miles-cli-bench-") as tmp:
        trees = {"current": REPO}
        if args.baseline_ref:
            trees["baseline"] = unpack(args.baseline_ref, Path(tmp))
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "python -c pass": ([sys.executable, "-c", "pass"], base_env),
        }
        for case, case_args in CASES.items():
            for tree_name, root in trees.items():
                env = {**base_env, "PYTHONPATH": source_path(root)}
                variants[f"{case} {tree_name}"] = ([sys.executable, "-m", "miles.cli.main", *case_args], env)
        results = measure(variants, args.repeats)

    ratios: dict[str, float] = {}
    for case in CASES:
        for metric in ("wall_s", "cpu_s"):
            ratios[f"{case} current / python -c pass, {metric}"] = ratio(results, f"{case} current", "python -c pass", metric)
            if args.baseline_ref:
                ratios[f"{case} baseline / current, {metric}"] = ratio(results, f"{case} baseline", f"{case} current", metric)
    report = {
        "command": " ".join(["scripts/cli_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "cases": {case: " ".join(["miles", *a]) for case, a in CASES.items()},
        "baseline_ref": args.baseline_ref,
        "current_commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True, check=False).stdout.strip(),
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "results": results,
        "ratios": ratios,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
