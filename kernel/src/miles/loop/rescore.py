"""``miles replay RUN_DIR --step N --rescore``: score a step's recorded episodes again, with the
run's rewards or changed ones, and compare. Nothing is generated and nothing in the run folder
changes: the episodes come from the step's dump (:mod:`miles.loop.step_dump`).

A sample whose reward failed in the run (status ``failed``, exit reason ``reward_error``: a
reward that raised or timed out) is scored again as ``completed``: re-scoring after fixing the
reward is the point. Its original status (completed or truncated) is not in the dump.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from miles_contracts import ExitReason, Process, RunContext, Sample, Status

from miles.config import MilesConfig
from miles.loop.step_dump import dumped_episodes
from miles.rewards.scoring import reward_name_of, score_samples_blocking


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def rescore_step(config: MilesConfig, run_dir: Path, step: int, *, reward: str | None = None) -> dict[str, Any]:
    """Score step ``step``'s episodes with ``config``'s rewards (``reward``: one reward for every
    sample, a row's own ``metadata["reward"]`` included); per-sample old and new rewards and a summary."""
    from miles.kernel import Kernel

    episodes = [episode for episode, _ in dumped_episodes(run_dir, step)]
    old = [(s.reward, s.status.value) for s in episodes]
    for sample in episodes:
        if reward is not None:
            sample.metadata["reward"] = reward
        if sample.status is Status.FAILED and sample.exit_reason is ExitReason.REWARD_ERROR:
            sample.finish(Status.COMPLETED, None)
        sample.reward, sample.role_rewards = None, {}
    kernel = Kernel.load(config.plugin_selection)
    ctx = RunContext(config, kernel, Process.driver(), None)
    kernel.configure(ctx)
    report = score_samples_blocking(episodes, ctx)
    rows = [_row(s, was, was_status, config.reward.name) for s, (was, was_status) in zip(episodes, old, strict=True)]
    changed = sum(r["old"] != r["new"] for r in rows)
    return {
        "run": str(run_dir), "step": step, "samples": rows,
        "summary": {
            "samples": len(rows), "changed": changed, "scored": report.scored, "failed": report.failed,
            "skipped": report.skipped, "old_mean": _mean([r["old"] for r in rows]),
            "new_mean": _mean([r["new"] for r in rows]), "errors": report.errors,
        },
    }


def _row(sample: Sample, old: float | None, old_status: str, default: str) -> dict[str, Any]:
    row: dict[str, Any] = {"index": sample.index, "group": sample.group_index, "old": old, "new": sample.reward,
                           "status": sample.status.value, "old_status": old_status}
    if sample.status.value in (Status.COMPLETED.value, Status.TRUNCATED.value) or sample.reward is not None:
        row["reward"] = reward_name_of(sample, default)
    if sample.role_rewards:
        row["role_rewards"] = dict(sample.role_rewards)
    if sample.exit_detail and sample.exit_reason is ExitReason.REWARD_ERROR:
        row["error"] = sample.exit_detail
    return row
