"""The sample ledger of real `miles train` runs (CPU, tiny random model, the real engine, router,
FSDP backend and weight transport): a clean sync run, and a fully_async run killed mid-step and
resumed. ``miles ledger`` reads what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 4


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _data(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say something about {w}.", "label": w}) + "\n"
                            for w in ("apples", "rivers", "clocks", "stars")[:PROMPTS]))
    return path


def _args(tiny_model: Path, out: Path, name: str, reward_url: str, *extra: str) -> list[str]:
    return [
        f"model.name={tiny_model}", f"run.output_dir={out}", f"run.name={name}", "data.source=jsonl",
        f"data.path={_data(out)}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8", "reward.name=remote", f"reward.remote_url={reward_url}", *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _ledger(run: Path) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "ledger", str(run)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=_env())
    return out.returncode, json.loads(out.stdout)


@pytest.mark.slow
def test_a_sync_run_trains_or_filters_every_prompt_of_each_epoch_exactly_once(
        tiny_model: Path, tmp_path: Path, vowel_reward: str) -> None:
    """Four steps of two prompts over four: two whole epochs, each prompt of each trained (or
    filtered by zero_variance, with that reason) exactly once; the loop checked each epoch as it
    closed and said so."""
    args = _args(tiny_model, tmp_path, "clean", vowel_reward, "run.steps=4", "rollout.filters=[zero_variance]")
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "epoch 0 closed:" in out.stderr and "0 lost, 0 duplicated" in out.stderr
    code, report = _ledger(tmp_path / "clean")
    assert code == 0 and (report["lost"], report["duplicated"], report["status"]) == (0, 0, "completed")
    closed = [e for e in report["epochs"] if e["closed"]]
    assert len(closed) >= 1
    for epoch in closed:
        assert epoch["trained"] + epoch["filtered"].get("zero_std", 0) == PROMPTS and not epoch["dropped"]
    assert report["trained"] == 4 * 2  # each step's two groups
    # the final checkpoint compacted the closed epochs: one summary line each, their events gone
    summaries = (tmp_path / "clean" / "ledger" / "epochs.jsonl").read_text().splitlines()
    assert len(summaries) == len(closed)


@pytest.mark.slow
def test_a_fully_async_run_killed_mid_step_and_resumed_loses_and_repeats_no_prompt(
        tiny_model: Path, tmp_path: Path, reward_gate) -> None:
    """The third group's scoring is held, so that group is in flight when steps 1 and 2 train on
    others and step 2's checkpoint is written (past its prompt's data position); then the whole
    run is SIGKILLed. The resumed run draws exactly that prompt again, with its ids, before new
    ones; every epoch that closed has each prompt trained exactly once (before, fully_async
    resumed past such prompts: they were never trained)."""
    run = tmp_path / "killed"
    reward_gate.hold = 3
    args = _args(tiny_model, tmp_path, "killed", reward_gate.url, "run.mode=fully_async", "run.steps=6",
                 "run.save_every=1", "rollout.concurrency=4", "algorithm.correction=tis")
    proc = LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], tmp_path / "killed.out", cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}).start()
    checkpoint = run / "checkpoints" / "step_000002" / "miles-state.json"
    try:
        proc.wait_ready(reward_gate.reached.is_set, "the third group's scoring held at the reward server")
        proc.wait_ready(checkpoint.is_file, "step 2's checkpoint")
    finally:
        proc.kill()  # the driver and everything it started, mid-step
    reward_gate.released.set()
    resumed = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", "--resume", str(run)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stderr

    code, report = _ledger(run)
    assert code == 0, report
    assert (report["lost"], report["duplicated"], report["resumes"]) == (0, 0, 1)
    assert report["trained"] == 6 * 2  # six steps of two groups, none twice
    closed = [e for e in report["epochs"] if e["closed"]]
    assert len(closed) >= 2 and all(e["trained"] + sum(e["dropped"].values()) == PROMPTS for e in closed[:-1])
    # the prompt held at the kill (and any other in flight at the checkpoint) was drawn again: its
    # epoch counts it once among the redrawn and once among the trained
    assert sum(e["redrawn"] for e in report["epochs"]) >= 1
