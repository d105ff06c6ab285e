"""The ending every live-engine check script shares: one JSON line per check in a file, a summary
line, and the exit status (1 when a check failed or none ran)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(path: Path, results: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in results))


def exit_status(results: list[dict]) -> int:
    failed = [r["check"] for r in results if r["outcome"] == "failed"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed; failed: {failed or 'none'}", flush=True)
    return 1 if failed or not results else 0
