"""Summarise `longtail_e2e.sh`'s runs: per arm (prefix cache + tree off / on), the median over
runs of each run's median step, rollout and train time (steps 2.., the bench's own figures), the
prefix cache's hit rate from the router's metrics, and the off / on ratios with their spread.

    uv run python scripts/prefix/longtail_e2e_summary.py OUT_DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _run_figures(report: Path) -> dict[str, float | None]:
    data = json.loads(report.read_text())
    run = data["runs"]["sync"][0]
    folder = next((report.parent / f"runs-{report.stem}").glob("*/metrics.jsonl"), None)
    hit_rates = []
    if folder is not None:
        for line in folder.read_text().splitlines():
            rate = json.loads(line).get("router/prefix_cache_hit_rate")
            if rate is not None:
                hit_rates.append(float(rate))
    return {"step_s": run["step_s"]["median"], "rollout_s": run["wait_batch_s"]["median"],
            "train_s": run["train_s"]["median"],
            "prefix_cache_hit_rate": statistics.median(hit_rates) if hit_rates else None}


def summarise(out: Path) -> dict[str, object]:
    arms: dict[str, list[dict[str, float | None]]] = {"off": [], "on": []}
    for arm in arms:
        for report in sorted(out.glob(f"{arm}-*.json")):
            arms[arm].append(_run_figures(report))
    result: dict[str, object] = {"runs": arms}
    for key in ("step_s", "rollout_s", "train_s"):
        off = [r[key] for r in arms["off"] if r[key] is not None]
        on = [r[key] for r in arms["on"] if r[key] is not None]
        if off and on:
            ratios = [a / b for a, b in zip(off, on, strict=False)]  # repeat k of each arm ran side by side in time
            median = statistics.median(ratios)
            result[key] = {"off_median": statistics.median(off), "on_median": statistics.median(on),
                           "off_over_on": median, "ratio_per_repeat": ratios,
                           "spread_pct": round(100 * (max(ratios) - min(ratios)) / median, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = summarise(args.out)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
