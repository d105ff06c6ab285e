"""Compare the runs of two ``scripts/identical_runs/run.sh`` folders: every loss, gradient norm,
advantage statistic and rollout number of every step must be equal to the bit.

    python scripts/identical_runs/compare.py OUT_A OUT_B     # exit 0 when all are identical
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = (
    "train/loss", "train/pg_loss", "train/grad_norm", "train/kl_loss", "train/entropy", "train/pg_clipfrac",
    "train/critic/value_loss", "train/critic/grad_norm", "train/train_rollout_logprob_abs_diff",
    "advantage/advantage_mean", "advantage/advantage_std", "advantage/advantage_min", "advantage/advantage_max",
    "advantage/return_mean", "rollout/reward_mean", "rollout/response_len_mean", "perf/rollout_tokens",
)


def records(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main(a: Path, b: Path) -> int:
    same = True
    for run in sorted(p.name for p in a.iterdir() if p.is_dir()):
        left, right = records(a / run), records(b / run)
        if not left or len(left) != len(right):
            print(f"{run}: {len(left)} steps in {a}, {len(right)} in {b}")
            same = False
            continue
        diffs = [(x["step"], key, x.get(key), y.get(key)) for x, y in zip(left, right, strict=True)
                 for key in KEYS if (key in x or key in y) and x.get(key) != y.get(key)]
        compared = sum(key in x for x in left for key in KEYS)
        print(f"{run}: {len(left)} steps, {compared} values, {'identical' if not diffs else f'{len(diffs)} differ'}")
        for step, key, x, y in diffs:
            print(f"    step {step} {key}: {x!r} vs {y!r}")
        same &= not diffs
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
