"""The run folder ``<output_dir>/<name>/`` and its checkpoints.

    config.yaml              the resolved config the run started with (mode 0600: it can hold secrets)
    metrics.jsonl            one line per step (the jsonl tracker)
    logs/<service>.log       engine, router and session-server output (0600, secrets redacted)
    samples/step_000003.jsonl  every sample of a step (prompt, response, reward, status, metadata; with
                               run.dump_tokens its tokens; ``batch_group`` on the episodes trained on)
    checkpoints/step_000004/   backend state + miles-state.json (written last: its presence marks
                               a complete checkpoint)
    ledger/events.jsonl      what became of every prompt drawn (:mod:`miles.loop.ledger`), and
    ledger/epochs.jsonl      the summaries of closed epochs
    hf/                      the final model as a Hugging Face folder (``run.export_hf``)

Checkpoints are written every ``run.save_every`` steps and after the last step (``run.save_final``).
After each save the folder keeps the ``run.keep_checkpoints`` newest complete checkpoints and
deletes the rest, incomplete ones (a save that was interrupted) included, so disk use stays at
``keep_checkpoints`` checkpoints, plus the one being written during a save.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_contracts import Sample

from miles.config import MilesConfig
from miles.errors import MilesError
from miles.private_files import write_private_text

STATE_FILE = "miles-state.json"
CONFIG_FILE = "config.yaml"
"""The run's resolved config: written when the run starts, read by every service process it starts."""


def new_run_dir(config: MilesConfig) -> Path:
    name = config.run.name or time.strftime("miles-%Y%m%d-%H%M%S")
    run_dir = config.run.output_dir / name
    if (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        raise MilesError(
            f"run folder {run_dir} already holds checkpoints; continue it with `miles train --resume {run_dir}` "
            f"or choose another run.name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_private_text(run_dir / CONFIG_FILE, config.to_yaml())
    return run_dir


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders, complete or not, oldest step first (by number: names stop sorting
    numerically past step 999999)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def _complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoint folders, oldest step first."""
    return [p for p in _checkpoints(run_dir) if _complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.rename(path / STATE_FILE)


def read_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
    return state


def prune_checkpoints(run_dir: Path, keep: int) -> tuple[list[Path], list[Path]]:
    """Keep the ``keep`` newest complete checkpoints; delete older ones and every incomplete one.

    Call it right after a checkpoint is complete (nothing else is being written then). Returns
    ``(removed, failed)``: the folders deleted and those that could not be (the caller reports
    them: a full disk is the reason to prune at all, so a failure must not pass silently).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    folders = _checkpoints(run_dir)
    complete = [p for p in folders if _complete(p)]
    doomed = [p for p in folders if not _complete(p)] + complete[:-keep]
    removed: list[Path] = []
    failed: list[Path] = []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        (failed if path.exists() else removed).append(path)
    return removed, failed


def dump_path(run_dir: Path, step: int, kind: str = "samples") -> Path:
    """Where step ``step``'s dump of ``kind`` is (what :func:`dump_samples` writes)."""
    return run_dir / kind / f"step_{step:06d}.jsonl"


def dumped_steps(run_dir: Path, kind: str = "samples") -> list[int]:
    """The steps that have a dump of ``kind``, in order."""
    folder = run_dir / kind
    if not folder.is_dir():
        return []
    return sorted(int(s) for s in (p.stem.removeprefix("step_") for p in folder.glob("step_*.jsonl")) if s.isdigit())


def dump_samples(run_dir: Path, step: int, samples: list[Sample], kind: str = "samples", *, tokens: bool = False,
                 trained: Sequence[Sequence[Sample]] = ()) -> Path:
    """Write ``samples`` to ``<run>/<kind>/step_<n>.jsonl``, one episode a line. ``trained``: the
    groups the step's batch was built from, in batch order; each of their episodes' lines gets
    ``batch_group`` (the group's position), which ``miles replay`` rebuilds the batch from."""
    path = dump_path(run_dir, step, kind)
    path.parent.mkdir(exist_ok=True)
    position = {id(s): n for n, group in enumerate(trained) for s in group}
    with path.open("w") as f:
        for s in samples:
            row = _dumped(s, tokens=tokens)
            if id(s) in position:
                row["batch_group"] = position[id(s)]
            f.write(json.dumps(row) + "\n")
    return path


def _dumped(s: Sample, *, tokens: bool) -> dict[str, Any]:
    """One sample's line; an episode's other branches nest under ``branches`` in the same shape."""
    row: dict[str, Any] = {
        "index": s.index, "group": s.group_index, "prompt": s.prompt, "label": s.label,
        "response": s.response, "reward": s.reward, "status": s.status.value,
        "exit_reason": s.exit_reason.value if s.exit_reason else None, "exit_detail": s.exit_detail,
        "response_tokens": s.response_length, "weight_versions": s.weight_versions,
        "metadata": s.metadata,  # per-sample reward selection and data fields: what a re-score needs
    }
    if tokens:
        row.update(tokens=s.tokens, loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
                   token_versions=s.token_versions)
    if s.branch is not None:
        row["branch"] = s.branch.to_dict()
    if s.role_rewards:
        row["role_rewards"] = s.role_rewards
    if s.branches:
        row["branches"] = [_dumped(b, tokens=tokens) for b in s.branches]
    return row
