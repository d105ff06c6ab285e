"""Does the embedded default learn? `miles train` with no config file, per seed and variant, on CPU.

    uv run python scripts/learning/default_cpu.py --out-dir /tmp/default-cpu --seeds 0 1 2 \\
        --variant default --variant lr1e-6 train.lr=1e-6 --json docs/benchmarks/learning-cpu.json

Runs one at a time (parallel runs fight for the cores), each as
`miles train run.seed=S data.seed=S run.save_final=false <variant overrides> <evaluation>` with
OMP_NUM_THREADS=1, and prints JSON: per run the rollout reward of every step, the mean of the
first and of the last three steps, the held-out accuracy after the last step, wall and CPU
seconds; per variant the lowest and highest seed of each. The evaluation (64 held-out problems x 2
samples at the rollout temperature, after the last step only) is not part of the embedded default;
it changes nothing the run trains on.

One torch thread per process: on the 2-core machine this was measured on, shared with other jobs,
the default two threads made a rollout of 16 samples take 221 s instead of 12 s (threads waiting
for each other whenever one is descheduled). A run folder that already holds every step is read,
not run again (its timing.json, written when the script ran it, holds the times).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from miles.embedded_default import LEARNING_KEYS, setting

EVALUATION = ["eval.every=10", "eval.num_prompts=64", "eval.greedy=false", "eval.samples_per_prompt=2"]
WINDOW = 3  # steps averaged at each end


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(run_dir: Path, overrides: list[str], seed: int) -> None:
    """One `miles train` into ``run_dir``; its wall and CPU seconds go to ``run_dir/timing.json``."""
    args = [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", f"run.seed={seed}", f"data.seed={seed}",
            "run.save_final=false", *overrides, *EVALUATION]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start, cpu = time.monotonic(), _children_cpu_s()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args], stdout=log, stderr=log, env=env)
    if done.returncode:
        raise SystemExit(f"{run_dir.name} failed (exit {done.returncode}); see {log.name}")
    timing = {"wall_s": round(time.monotonic() - start, 1), "cpu_s": round(_children_cpu_s() - cpu, 1),
              "omp_num_threads": 1}
    (run_dir / "timing.json").write_text(json.dumps(timing) + "\n")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize_run(run_dir: Path, seed: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [round(r["rollout/reward_mean"], 4) for r in sorted(rows, key=lambda r: r["step"])]
    evals = [r for r in rows if "eval/accuracy" in r]
    timing_file = run_dir / "timing.json"
    return {
        "seed": seed,
        "reward_per_step": rewards,
        f"reward_first_{WINDOW}": round(_mean(rewards[:WINDOW]), 4),
        f"reward_last_{WINDOW}": round(_mean(rewards[-WINDOW:]), 4),
        "response_len_first_last": [round(rows[0]["rollout/response_len_mean"], 1),
                                    round(rows[-1]["rollout/response_len_mean"], 1)],
        "heldout_accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
        **(json.loads(timing_file.read_text()) if timing_file.is_file() else {}),
    }


def summarize_variant(runs: list[dict[str, Any]], config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    def bounds(key: str) -> list[float] | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return [min(values), max(values)] if values else None

    return {
        "overrides": overrides,
        "settings": {key: setting(config, key) for key in LEARNING_KEYS},
        "runs": runs,
        "range_over_seeds": {key: bounds(key) for key in (f"reward_first_{WINDOW}", f"reward_last_{WINDOW}",
                                                          "heldout_accuracy_after", "wall_s", "cpu_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "OVERRIDE"),
                        help="a name, then the overrides that make it (none: the embedded default)")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = args.variant or [["default"]]
    result: dict[str, Any] = {"command": "miles train (no config file) " + " ".join(EVALUATION), "variants": {}}
    for name, *overrides in variants:
        runs = []
        for seed in args.seeds:
            run_dir = args.out_dir / f"{name}-s{seed}"
            metrics = run_dir / "metrics.jsonl"
            config_file = run_dir / "config.yaml"
            if not (metrics.is_file() and config_file.is_file()) or not _complete(metrics, config_file):
                run_once(run_dir, overrides, seed)
            runs.append(summarize_run(run_dir, seed))
        config = yaml.safe_load((args.out_dir / f"{name}-s{args.seeds[0]}" / "config.yaml").read_text())
        result["variants"][name] = summarize_variant(runs, config, overrides)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


def _complete(metrics: Path, config_file: Path) -> bool:
    steps = yaml.safe_load(config_file.read_text())["run"]["steps"]
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) >= steps


if __name__ == "__main__":
    main()
