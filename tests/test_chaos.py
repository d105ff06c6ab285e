"""``miles chaos`` on a real run (CPU, tiny random model; the real engine, router, FSDP trainer,
weight transport and the math reward's worker pool): ten SIGKILLs of processes the run really
has, each recovered as a user would, and the sample ledger shows no prompt lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess

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


def _kill_engine_once_step_generates(run: Path, step_groups: int, process: LoggedProcess) -> int:
    """SIGKILL the run's engine as soon as the ledger shows a group past the first ``step_groups``
    in flight (a later step's generation has started); the pid killed."""
    events = run / "ledger" / "events.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.returncode is None:
        lines = events.read_text().splitlines() if events.exists() else []
        if any('"in_flight"' in line and json.loads(line)["group"] >= step_groups for line in lines[:-1]):
            engine = next(row for row in json.loads((run / "services.json").read_text()) if row.get("role") == "engine")
            os.kill(engine["pid"], signal.SIGKILL)
            return int(engine["pid"])
        time.sleep(0.05)
    raise AssertionError(f"step 2 never started generating (exit {process.returncode})")


@pytest.mark.slow
def test_an_engine_killed_mid_rollout_leaves_a_deterministic_run_on_the_weights_of_one_without_faults(
        tiny_model: Path, tmp_path: Path, vowel_reward: str) -> None:
    """run.deterministic, sync: the engine is SIGKILLed while step 2 generates. The groups it spoiled
    are generated again in place (same prompts, sample ids and seeds) once the supervisor has it
    back with the trainer's weights, so the run ends on the very weights of the same run without
    the kill (``train/weights_digest`` of the last step). A reward that scores vowels makes the
    weights move every step (a tiny model's arithmetic scores 0): equal digests are not vacuous."""
    from miles.chaos.reference import last_step_digest

    def args(name: str) -> list[str]:
        return [f"model.name={tiny_model}", f"run.output_dir={tmp_path}", f"run.name={name}", "run.mode=sync",
                "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=32",
                "reward.name=remote", f"reward.remote_url={vowel_reward}", "run.steps=3", "run.save_final=false",
                "run.deterministic=true", "run.weights_digest=true"]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    train = [sys.executable, "-m", "miles.cli.main", "train"]
    # the run without the kill goes alongside (its own folder, services and ports): a deterministic
    # run's weights do not depend on what else the machine runs, and the two start-ups overlap
    runs = {name: LoggedProcess([*train, *args(name)], tmp_path / f"{name}.log", cwd=ROOT, env=env)
            for name in ("clean", "faulted")}
    try:
        for run in runs.values():
            run.start()
        _kill_engine_once_step_generates(tmp_path / "faulted", 2, runs["faulted"])
        for name, run in runs.items():
            assert run.wait_exit(f"the {name} run to finish", deadline_s=300) == 0, run.log_tail(60)
    finally:
        for run in runs.values():
            run.stop()  # the run's whole process group: nothing it started outlives the test
    ledger = (tmp_path / "faulted" / "ledger" / "events.jsonl").read_text()
    assert '"reason": "redo"' in ledger  # the kill spoiled step 2's groups, and they were redone
    metrics = [json.loads(line) for line in (tmp_path / "faulted" / "metrics.jsonl").open()]
    assert metrics[1]["rollout/groups_redone"] >= 1 and len({m["train/weights_digest"] for m in metrics}) == 3
    assert last_step_digest(tmp_path / "faulted", 3) == last_step_digest(tmp_path / "clean", 3) is not None
