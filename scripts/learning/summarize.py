"""Per-step timing summary of a `miles train` metrics.jsonl (the learning test's Miles column).

    python scripts/learning/summarize.py runs/<name>/metrics.jsonl [--skip 2]

Prints JSON: median wall time per step (from the rows' timestamps, so it includes everything the
loop does), the same over steps without an evaluation, the median of each `time/*` phase, rollout
tokens/s, first/last reward and eval accuracy, and the train/rollout log-prob difference (mean and
max over steps; with rollout.true_on_policy both must be 0, and the mismatched-token count too). `--skip N` leaves the first N steps out of the
medians (CUDA-graph capture and allocator warm-up happen there).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def summarize(rows: list[dict], skip: int) -> dict:
    steps = sorted((r for r in rows if "step" in r and "time" in r), key=lambda r: r["step"])
    walls = [(b, b["time"] - a["time"]) for a, b in zip(steps, steps[1:], strict=False)][max(0, skip - 1):]
    phases = sorted({k for r in steps for k in r if k.startswith("time/")})
    timed = steps[skip:]
    evals = [r for r in steps if "eval/accuracy" in r]
    return {
        "steps": len(steps),
        "step_s_median": statistics.median(w for _, w in walls) if walls else None,
        "step_s_median_without_eval": statistics.median(w for r, w in walls if "time/eval" not in r) if walls else None,
        "phase_s_median": {k: statistics.median(r[k] for r in timed if k in r) for k in phases if any(k in r for r in timed)},
        "rollout_tokens_per_s_median": statistics.median(r["perf/rollout_tokens_per_s"] for r in timed if "perf/rollout_tokens_per_s" in r) if timed else None,
        "reward_first_last": [steps[0].get("rollout/reward_mean"), steps[-1].get("rollout/reward_mean")] if steps else None,
        "eval_accuracy_first_last": [evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]] if evals else None,
        **_diffs(steps),
    }


def _diffs(steps: list[dict]) -> dict:
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in steps if "train/train_rollout_logprob_abs_diff" in r]
    if not diffs:
        return {}
    out = {"logprob_abs_diff_first_last": [diffs[0], diffs[-1]], "logprob_abs_diff_max_over_steps": max(diffs),
           "steps_with_nonzero_diff": sum(1 for d in diffs if d != 0)}
    checked = [r["train/true_on_policy_checked_tokens"] for r in steps if "train/true_on_policy_checked_tokens" in r]
    if checked:
        out["true_on_policy_checked_tokens"] = sum(checked)
        out["true_on_policy_mismatched_tokens"] = sum(r.get("train/true_on_policy_mismatched_tokens", 0) for r in steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out of the medians")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    print(json.dumps(summarize(rows, args.skip), indent=2))


if __name__ == "__main__":
    main()
