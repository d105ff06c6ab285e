"""What compiled bytecode saves: process start-up with and without ``.pyc`` files (docs/benchmarks/startup.md).

    uv run python scripts/startup/bench.py [--repeats 3] [--train] [--out FILE]

``PYTHONDONTWRITEBYTECODE=1`` (set on the machines our CI runs on) keeps Python from writing the
``.pyc`` files it compiles, so without bytecode compiled at install every process compiles every
module it imports from source again. Both sides run here with ``PYTHONDONTWRITEBYTECODE=1``; "without"
points ``PYTHONPYCACHEPREFIX`` at an empty folder, which Python then searches instead of each
package's ``__pycache__`` (and, not writing, finds nothing), so it compiles as a fresh install
without ``--compile-bytecode`` would. The variable is inherited, so a whole ``miles train`` process
tree is measured alike.

Commands: importing what an engine process imports (torch, transformers, the engine server);
``miles --help``; with ``--train``, a 2-step ``miles train`` of the tiny test model (driver, trainer
rank, engine and router: four processes that each import torch). One warm-up per side and command,
then ``--repeats`` alternating runs; CPU seconds (user + system, children included) and wall
seconds, median and range, and the ratio without / with. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train", action="store_true", help="also a 2-step miles train of the tiny model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    python = sys.executable
    miles = str(Path(python).with_name("miles"))
    commands = {
        "import torch + transformers + engine server": [python, "-c", "import torch, transformers, miles_engine.server"],
        "miles --help": [miles, "--help"],
    }
    if args.train:
        from miles_models.testing import tiny_model

        model = tiny_model("dense")
        runs = tempfile.mkdtemp(prefix="startup-bench-")
        commands["miles train (tiny model, 2 steps)"] = [
            miles, "train", f"model.name={model}", f"run.output_dir={runs}", "run.steps=2", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "reward.name=f1", "eval.every=0",
            "run.save_final=false"]
    empty = tempfile.mkdtemp(prefix="no-pyc-")
    base = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    base.pop("PYTHONPYCACHEPREFIX", None)
    sides = {"with_pyc": base, "without_pyc": {**base, "PYTHONPYCACHEPREFIX": empty}}
    result: dict[str, object] = {"repeats": args.repeats, "cpu_count": os.cpu_count(),
                                 "load_average_at_start": os.getloadavg()[0], "commands": {}}
    for name, command in commands.items():
        samples: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
        for env in sides.values():
            measure(command, env)  # warm-up: the page cache, the tiny model's files
        for _ in range(args.repeats):
            for side, env in sides.items():
                samples[side].append(measure(command, env))
        entry: dict[str, object] = {}
        for side, pairs in samples.items():
            entry[side] = {"cpu_s": summary([c for c, _ in pairs]), "wall_s": summary([w for _, w in pairs])}
        with_cpu = statistics.median(c for c, _ in samples["with_pyc"])
        without_cpu = statistics.median(c for c, _ in samples["without_pyc"])
        entry["cpu_ratio_without_over_with"] = round(without_cpu / with_cpu, 2)
        result["commands"][name] = entry  # type: ignore[index]
        print(name, json.dumps(entry), flush=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
