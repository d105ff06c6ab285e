"""Plot reward and held-out accuracy per step of the learning test (docs/benchmarks/learning.md).

    python scripts/learning/plot.py docs/benchmarks/learning-miles-h200.metrics.jsonl \
        docs/benchmarks/learning-trl-h200.json docs/benchmarks/learning-h200.png \
        [docs/benchmarks/learning-miles-async-h200.metrics.jsonl]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _median_step(rows: list[dict]) -> float:
    """Median wall time between consecutive steps (everything the loop does, evaluations included)."""
    return statistics.median(b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:], strict=False))


def main(miles_metrics: str, trl_json: str, out: str, async_metrics: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(miles_metrics).read_text().splitlines()]
    trl = json.loads(Path(trl_json).read_text())["steps"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot([r["step"] for r in rows], [r["rollout/reward_mean"] for r in rows], label="Miles: rollout reward")
    ax[0].plot([s["step"] for s in trl if "reward" in s], [s["reward"] for s in trl if "reward" in s],
               label="TRL GRPOTrainer: rollout reward", alpha=0.8)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    ax[0].plot(*zip(*evals, strict=True), "o-", label="Miles: held-out accuracy (greedy, 256)")
    ax[0].set_xlabel("RL step (32 prompts x 8 samples)")
    ax[0].set_ylabel("reward / accuracy")
    ax[0].set_title("SmolLM2-135M-Instruct, GRPO, 2-digit addition, H200")
    ax[0].legend(fontsize=8)
    bars = {"Miles (sync)": _median_step(rows), "TRL": statistics.median(s["seconds"] for s in trl[1:])}
    if async_metrics:
        bars = {"Miles (sync)": bars["Miles (sync)"],
                "Miles (one_step_off)": _median_step([json.loads(line) for line in Path(async_metrics).read_text().splitlines()]),
                "TRL": bars["TRL"]}
    ax[1].bar(list(bars), list(bars.values()), color=["C0", "C2", "C1"][: len(bars)])
    for x, value in enumerate(bars.values()):
        ax[1].text(x, value, f"{value:.2f} s", ha="center", va="bottom")
    ax[1].set_ylabel("wall seconds per step (median, first step excluded)")
    ax[1].set_title("time per step (lower is better)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:5])
