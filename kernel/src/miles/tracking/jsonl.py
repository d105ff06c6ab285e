"""The ``jsonl`` tracker: ``runs/<name>/metrics.jsonl``, always on, the run's record of metrics.

One JSON object per ``log`` call -- ``{"step": 3, "time": 1767225600.5, "reward/mean": 0.4, ...}``
-- appended and flushed at once, so the file is complete up to the last step even after a crash.
Non-finite values are written as ``null`` (strict JSON). A resumed run appends to the same file,
after :func:`supersede_after` moved the records of the steps it will run again (those logged after
the checkpoint it resumes from) to ``metrics.superseded.jsonl``: one record per step, nothing lost.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_contracts import RunContext

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
RESERVED_KEYS = ("step", "time")


class JsonlTracker:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name {key!r} is reserved in {METRICS_FILE}; rename the metric (e.g. 'train/{key}')")
            record[key] = _json_value(key, value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _json_value(key: str, value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} is {value!r}; metrics are numbers")
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def jsonl_tracker(ctx: RunContext) -> JsonlTracker:
    return JsonlTracker(ctx.require_run_dir("the jsonl tracker") / METRICS_FILE)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl`` (``path`` is the file or the run folder), in order."""
    file = path / METRICS_FILE if path.is_dir() else path
    with file.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def supersede_after(run_dir: Path, step: int) -> int:
    """Move the records of steps after ``step`` (and unreadable lines) to ``metrics.superseded.jsonl``.

    A run resumed from the checkpoint of ``step`` runs the steps after it again; their first
    records (logged before the crash or Ctrl-C) would otherwise stay next to the new ones, two per
    step. So would a line torn by a crash in mid-write, which no reader could parse. Returns how
    many lines were moved. Call it before a tracker opens the file.
    """
    file = run_dir / METRICS_FILE
    if not file.is_file():
        return 0
    kept: list[str] = []
    moved: list[str] = []
    for line in file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            record_step = None
        (kept if isinstance(record_step, int) and record_step <= step else moved).append(line + "\n")
    if not moved:
        return 0
    with (run_dir / SUPERSEDED_FILE).open("a", encoding="utf-8") as superseded:
        superseded.writelines(moved)
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, file)
    return len(moved)
