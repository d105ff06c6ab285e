"""Compare the runs of scale.sh with the one-GPU baseline: JSON for docs/benchmarks/scale.md.

    python scripts/h200/scale_compare.py OUT_DIR [--baseline one-gpu] [--skip 2]

For every ``<part>.metrics.jsonl`` in OUT_DIR: median wall time per step and its spread (the
quartiles; each step is one repeat, the first ``--skip`` left out as warm-up), samples and rollout
tokens per second, the median phases, and the ratio of each against the baseline measured in the
same session (>1: faster than the baseline). Placement comes from ``<part>.services.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def describe(rows: list[dict], skip: int) -> dict:
    steps = sorted((r for r in rows if "step" in r and "time" in r), key=lambda r: r["step"])
    walls = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)][max(0, skip - 1):]
    timed = steps[skip:]
    samples = statistics.median(r["rollout/samples"] for r in timed) if timed else 0
    step_s = statistics.median(walls) if walls else None
    quartiles = statistics.quantiles(walls, n=4) if len(walls) >= 2 else [step_s, step_s, step_s]
    phases = sorted({k for r in timed for k in r if k.startswith("time/")})
    return {
        "steps": len(steps), "timed_steps": len(walls), "step_s_median": step_s,
        "step_s_quartiles": [quartiles[0], quartiles[2]],
        "samples_per_step": samples, "samples_per_s": samples / step_s if step_s else None,
        "rollout_tokens_per_s_median": statistics.median(r["perf/rollout_tokens_per_s"] for r in timed
                                                         if "perf/rollout_tokens_per_s" in r) if timed else None,
        "phase_s_median": {k: statistics.median(r[k] for r in timed if k in r) for k in phases},
        "reward_first_last": [steps[0].get("rollout/reward_mean"), steps[-1].get("rollout/reward_mean")] if steps else None,
    }


def placement(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [{k: row.get(k) for k in ("name", "gpus", "restarts")} for row in json.loads(path.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--baseline", default="one-gpu")
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out as warm-up")
    args = parser.parse_args()
    parts = {}
    for metrics in sorted(args.out.glob("*.metrics.jsonl")):
        name = metrics.name.removesuffix(".metrics.jsonl")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        parts[name] = {**describe(rows, args.skip), "processes": placement(args.out / f"{name}.services.json")}
    base = parts.get(args.baseline, {}).get("step_s_median")
    for part in parts.values():
        part["speedup_vs_baseline"] = base / part["step_s_median"] if base and part["step_s_median"] else None
    print(json.dumps({"baseline": args.baseline, "parts": parts}, indent=2))


if __name__ == "__main__":
    main()
