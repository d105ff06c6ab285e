"""Checkpoint retention in the run folder (``run.keep_checkpoints``) on real folders."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.loop.run_dir import checkpoint_dir, latest_checkpoint, prune_checkpoints, write_state


def _checkpoint(run: Path, step: int, *, complete: bool = True) -> Path:
    path = checkpoint_dir(run, step)
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(b"x" * 64)
    if complete:
        write_state(path, {"step": step})
    return path


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_keeps_the_newest_complete_checkpoints_and_drops_interrupted_saves(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 5, complete=False)  # a save that was interrupted, older than the newest
    _checkpoint(tmp_path, 9, complete=False)  # and one newer: as stale once step 8 is complete
    removed, failed = prune_checkpoints(tmp_path, keep=2)
    assert _steps(tmp_path) == ["step_000006", "step_000008"]
    assert sorted(p.name for p in removed) == ["step_000002", "step_000004", "step_000005", "step_000009"]
    assert failed == []
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 8)


def test_steps_are_ordered_by_number_past_six_digits(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 999_999)
    _checkpoint(tmp_path, 1_000_000)  # "step_1000000" sorts before "step_999999" as text
    prune_checkpoints(tmp_path, keep=1)
    assert _steps(tmp_path) == ["step_1000000"]
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1_000_000)


def test_a_run_without_checkpoints_has_nothing_to_prune(tmp_path: Path) -> None:
    assert prune_checkpoints(tmp_path, keep=1) == ([], [])
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=0)
