"""What ``miles view`` reads from a run folder: the step dumps, the metrics and the model name.

Everything here is data a run wrote (or someone handed over): it is parsed as JSON and YAML only,
never executed, and a line that does not parse is counted and skipped, not fatal, so one torn line
(a crash in mid-write) does not hide the rest of a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.errors import MilesError
from miles.loop.run_dir import dump_path


@dataclass(slots=True)
class StepDump:
    """One ``samples/step_<n>.jsonl``: its rows (one per episode) and how many lines did not parse."""

    step: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0


def read_step(run_dir: Path, step: int) -> StepDump:
    dump = StepDump(step)
    path = dump_path(run_dir, step)
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dump.unreadable += 1
                continue
            if isinstance(row, dict):
                dump.rows.append(row)
            else:
                dump.unreadable += 1
    return dump


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` that parse (none when the file is absent)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def model_name(run_dir: Path) -> str | None:
    """``model.name`` of the run's ``config.yaml``, or None when the folder has no readable one."""
    from miles.config import read_yaml
    from miles.errors import ConfigError

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        model = read_yaml(path).get("model")
    except ConfigError:
        return None
    name = model.get("name") if isinstance(model, dict) else None
    return str(name) if name else None


def choose_steps(available: list[int], spec: str | None, last: int) -> list[int]:
    """The steps to show: those ``spec`` names (``"3"``, ``"1,4"``, ``"2-5"``, mixed), or the
    ``last`` newest. A named step without a dump is an error that lists the steps there are."""
    if spec is None:
        return available[-last:] if last > 0 else list(available)
    wanted: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, final = int(low), int(high if dash else low)
        except ValueError:
            raise MilesError(f"--steps {spec!r}: {part!r} is not a step or a range; expected e.g. 3 or 1,4 or 2-5") from None
        if final < first:
            raise MilesError(f"--steps {spec!r}: range {part!r} ends before it starts")
        wanted.update(range(first, final + 1))
    missing = sorted(wanted - set(available))
    if missing:
        have = _ranges(available) or "none"
        raise MilesError(f"--steps {spec!r}: no sample dump for step(s) {_ranges(missing)}; the run folder has {have}")
    return sorted(wanted)


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts: list[str] = []
    start = prev = None
    for s in [*steps, None]:
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = s
    return ", ".join(parts)
