"""``miles replay RUN_DIR --step N``: train step N of a finished (or failed) run again, from its
dumps, with no engine, and say whether the loss and the update came out the same bits.

The weights before step N are rebuilt rather than stored per step: the replay starts from the
run's newest complete checkpoint *before* step N (``checkpoints/step_<k>``, k < N: weights,
optimiser and RNG state as they were after step k), or from the base model when there is none,
and trains steps k+1 .. N on the batches their dumps recorded (``batch_group``), the way the run's
learner did. Each replayed step's metrics are checked against ``metrics.jsonl``, so the first step
that drifts is named, not only step N. A run with ``run.weights_digest`` also logged a hash of the
weights after every update; the replay computes it again (equal weights after an update from equal
state mean equal gradients). Why this design, and what it cannot cover: docs/design/debugging.md.

The backend runs in this process as trainer rank 0 of a world of one (:class:`RankWorker`, the
object a rank process serves), so the same code path trains, hooks and digests as in the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config import MilesConfig
from miles.errors import MilesError
from miles.loop.learner import Learner
from miles.loop.run_dir import complete_checkpoints, read_state
from miles.loop.step_dump import batch_samples
from miles.tracking.jsonl import METRICS_FILE

DIGEST = "train/weights_digest"


def measured(key: str) -> bool:
    """A timing or a rate: a measurement, never expected to repeat."""
    return key.startswith(("time/", "perf/")) or "per_s" in key or key.endswith("/seconds")


@dataclass(slots=True)
class StepComparison:
    """One replayed step against what the run logged for it."""

    step: int
    replayed: dict[str, float]
    recorded: dict[str, float] | None
    differ: dict[str, dict[str, float | None]] = field(default_factory=dict)
    compared: int = 0

    @classmethod
    def of(cls, step: int, replayed: dict[str, float], recorded: dict[str, float] | None) -> StepComparison:
        comparison = cls(step, replayed, recorded)
        if recorded is None:
            return comparison
        for key, value in replayed.items():
            if measured(key) or not math.isfinite(value):  # NaNs never reach metrics.jsonl
                continue
            comparison.compared += 1
            if recorded.get(key) != value:
                comparison.differ[key] = {"recorded": recorded.get(key), "replayed": value}
        return comparison

    @property
    def equal(self) -> bool:
        return self.recorded is not None and self.compared > 0 and not self.differ

    def report(self) -> dict[str, Any]:
        kept = {k: v for k, v in self.replayed.items() if not measured(k)}
        return {"step": self.step, "equal": self.equal, "compared_metrics": self.compared,
                "differ": self.differ, "metrics": kept,
                "loss": kept.get("train/loss"), "weights_digest": kept.get(DIGEST),
                "recorded_weights_digest": (self.recorded or {}).get(DIGEST)}


def recorded_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """The run's logged metrics by step (a resumed run's later record of a step wins)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return {}
    records: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records[record["step"]] = {k: v for k, v in record.items() if isinstance(v, (int, float))}
    return records


def starting_checkpoint(run_dir: Path, step: int) -> tuple[Path | None, int]:
    """The newest complete checkpoint written before ``step`` trained, and its step (None, 0: the base model)."""
    before = [(p, k) for p in complete_checkpoints(run_dir) if (k := int(read_state(p)["step"])) < step]
    return before[-1] if before else (None, 0)


def replay_step(config: MilesConfig, run_dir: Path, step: int) -> dict[str, Any]:
    """Train steps up to ``step`` again (see the module docstring); a JSON-able report whose
    ``equal`` says whether step ``step`` reproduced every logged metric (its digest included)."""
    from miles.loop.runner import load_tokenizer
    from miles.trainer.rank import RankWorker

    if step < 1:
        raise MilesError(f"--step must be 1 or more (steps count from 1), got {step}")
    checkpoint, start = starting_checkpoint(run_dir, step)
    target = batch_samples(run_dir, step)  # every dump is read (and checked) before a model loads
    batches = {k: batch_samples(run_dir, k) for k in range(start + 1, step)} | {step: target}
    recorded = recorded_metrics(run_dir)
    worker = RankWorker(0)
    worker.init(config.to_dict(), None)
    try:
        if checkpoint is not None:
            worker.load_checkpoint(checkpoint)
        kernel = worker.context.kernel
        tokenizer = load_tokenizer(kernel.resolve_model(config.model.name))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        learner = Learner(config, kernel, worker, pad)
        steps = [StepComparison.of(k, learner.train(rows), recorded.get(k)) for k, rows in batches.items()]
    finally:
        worker.close()
    final = steps[-1]
    drifted = next((s.step for s in steps if not s.equal), None)
    return {
        "run": str(run_dir), "step": step,
        "started_from": str(checkpoint) if checkpoint is not None else "the base model",
        "replayed_steps": [s.step for s in steps],
        "equal": final.equal, "first_step_that_differs": drifted,
        "digest_recorded": DIGEST in (final.recorded or {}),
        **{k: v for k, v in final.report().items() if k != "step"},
        "earlier_steps": [s.report() | {"metrics": None} for s in steps[:-1]],
    }
