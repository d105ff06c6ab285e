"""``miles chaos`` on a real run (CPU, tiny random model; the real engine, router, FSDP trainer,
weight transport and the math reward's worker pool): ten SIGKILLs of processes the run really
has, each recovered as a user would, and the sample ledger shows no prompt lost or repeated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


@pytest.mark.slow
def test_ten_random_kills_of_a_fully_async_run_lose_and_repeat_no_prompt(tiny_model: Path, tmp_path: Path) -> None:
    """Seeded so that the kills fall on several kinds (trainer rank, engine, router, reward worker,
    driver): a killed rank or driver is resumed (at most two of them: each resume is a full
    start-up), the others are restarted by the run itself. The
    command's own verdict reads the ledger (0 lost, 0 duplicated in every epoch); the test reads
    it again with ``miles ledger``."""
    args = [f"model.name={tiny_model}", f"run.output_dir={tmp_path}", "run.name=chaos", "data.source=arithmetic",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
            "reward.name=math", "reward.timeout=10", "run.mode=fully_async", "algorithm.correction=tis",
            "run.steps=40", "run.save_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "chaos", *args, "--injections", "10", "--seed", "3",
                          "--gap", "0.5,2", "--max-resumes", "2", "--recovery-timeout", "180",
                          "--timeout", "480"], capture_output=True, text=True, timeout=540, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["passed"] and report["injections"]["done"] == 10
    assert len(report["injections"]["by_kind"]) >= 3, report["injections"]
    assert report["recoveries"]["hung"] == 0 and 1 <= report["recoveries"]["resume"] <= 2
    assert (report["ledger"]["lost"], report["ledger"]["duplicated"]) == (0, 0)
    assert "sandbox" in report["kinds_absent"]  # this run has none; the report says so
    ledger = subprocess.run([sys.executable, "-m", "miles.cli.main", "ledger", str(tmp_path / "chaos")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert ledger.returncode == 0 and json.loads(ledger.stdout)["status"] == "completed"


@pytest.mark.slow
def test_rollout_kills_of_a_deterministic_run_leave_its_final_weights_as_without_them(
        tiny_model: Path, tmp_path: Path, vowel_reward: str) -> None:
    """run.deterministic, sync: an engine or the router is SIGKILLed while the run goes on; the
    groups the kill spoiled are generated again in place (same prompts, sample ids, seeds) once the
    services are back, so the run ends on the very weights of the same run without a fault, which
    ``miles chaos --deterministic`` runs after it and compares (``train/weights_digest``). A reward
    that scores vowels makes the weights move every step (a tiny model's arithmetic scores 0)."""
    args = [f"model.name={tiny_model}", f"run.output_dir={tmp_path}", "run.name=det", "run.mode=sync",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
            "reward.name=remote", f"reward.remote_url={vowel_reward}", "run.steps=5", "run.save_final=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "chaos", *args, "--injections", "2", "--seed", "1",
                          "--kinds", "engine,router", "--gap", "0.1,0.6", "--deterministic", "--timeout", "400"],
                         capture_output=True, text=True, timeout=450, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["passed"] and report["injections"]["done"] == 2
    assert report["weights"]["final_weights_equal"] and report["weights"]["chaos_digest"] is not None
    digests = {json.loads(line).get("train/weights_digest") for line in (tmp_path / "det" / "metrics.jsonl").open()}
    assert len(digests) == 5  # the weights moved at every step: equal final weights are not vacuous
