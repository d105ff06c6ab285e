"""Plot reward and held-out accuracy per step of the learning test (docs/benchmarks/learning.md).

    python scripts/learning/plot.py docs/benchmarks/learning-miles-h200.metrics.jsonl \
        docs/benchmarks/learning-trl-h200.json docs/benchmarks/learning-h200.png
"""

from __future__ import annotations

import json
import sys


def main(miles_metrics: str, trl_json: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(miles_metrics)]
    trl = json.load(open(trl_json))["steps"]
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
    ax[1].bar(["Miles", "TRL"], [sum(r["time/rollout"] + r.get("time/train", 0) + r.get("time/sync", 0)
                                     for r in rows) / len(rows),
                                 sum(s["seconds"] for s in trl) / len(trl)])
    ax[1].set_ylabel("wall seconds per step (mean)")
    ax[1].set_title("time per step (lower is better)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
