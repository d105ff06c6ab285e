"""``miles chaos --deterministic``: the same run without faults, and whether both ended on the
same weights.

In ``run.deterministic`` mode a group that a dead rollout service spoiled is redone in place
(:mod:`miles.loop.redo`), so a run whose faults touched only rollout must end with the very bits of
a run without them. Both runs log ``train/weights_digest`` (``run.weights_digest``) after every
step; the digests of the last step are compared. Runs in the ``miles chaos`` process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.chaos.targets import KINDS, ROLLOUT_KINDS
from miles.errors import MilesError
from miles.executor.children import spawn, terminate_group

DETERMINISTIC_OVERRIDES = ("run.deterministic=true", "run.weights_digest=true")
"""What ``--deterministic`` adds to the run's overrides (and to the reference run's)."""


def check_deterministic_kinds(kinds: tuple[str, ...]) -> None:
    """Only rollout faults leave the weights alone: a killed trainer rank or driver resumes from a
    checkpoint, which a deterministic run reproduces too, but the issue's property is about
    rollout, and the comparison is only claimed for it."""
    others = [kind for kind in kinds if kind not in ROLLOUT_KINDS]
    if others:
        allowed = ",".join(kind for kind in KINDS if kind in ROLLOUT_KINDS)
        raise MilesError(f"--deterministic compares final weights with a run without faults, which holds for "
                         f"rollout faults only; --kinds has {', '.join(others)}: use --kinds {allowed} (or a subset)")


@dataclass(frozen=True)
class WeightsVerdict:
    equal: bool
    chaos_digest: float | None
    reference_digest: float | None
    reference_run: Path
    seconds: float
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"final_weights_equal": self.equal, "chaos_digest": self.chaos_digest,
                "reference_digest": self.reference_digest, "reference_run": str(self.reference_run),
                "reference_seconds": round(self.seconds, 1), **({"error": self.error} if self.error else {})}


def last_step_digest(run_dir: Path, step: int) -> float | None:
    """``train/weights_digest`` of step ``step`` in ``<run>/metrics.jsonl`` (the record a resume
    superseded is in another file), or None when it was not logged."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    digest = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("step") == step and "train/weights_digest" in record:
            digest = float(record["train/weights_digest"])
    return digest


def run_reference(argv: list[str], run_dir: Path, reference_dir: Path, steps: int, env: dict[str, str],
                  timeout: float) -> WeightsVerdict:
    """Run ``miles train ARGV`` (the chaos run's config and overrides, another ``run.name``) without
    faults to ``steps`` steps, then compare its last digest with the chaos run's."""
    started = time.monotonic()
    log_path = run_dir / "chaos" / "reference.log"
    with log_path.open("wb") as log:
        process = spawn([sys.executable, "-m", "miles.cli.main", "train", *argv], log=log, env=env)
        try:
            code = process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            terminate_group(process)
            code = None
    seconds = time.monotonic() - started
    ours, theirs = last_step_digest(run_dir, steps), last_step_digest(reference_dir, steps)
    error = None
    if code != 0:
        error = (f"the reference run {'did not finish in time' if code is None else f'exited with {code}'} "
                 f"(log {log_path})")
    elif ours is None or theirs is None:
        error = f"train/weights_digest of step {steps} is missing from {'the chaos run' if ours is None else 'the reference run'}"
    return WeightsVerdict(error is None and ours == theirs, ours, theirs, reference_dir, seconds, error)


__all__ = ["DETERMINISTIC_OVERRIDES", "WeightsVerdict", "check_deterministic_kinds", "last_step_digest",
           "run_reference"]
