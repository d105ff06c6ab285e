"""``miles rollout``: the example configs generate and score with the tiny model on CPU (the
embedded engine, the router, the session server for the agent), with no trainer, and write the
step dumps a training run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", "rollout", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)


def _check_run(out: subprocess.CompletedProcess[str], run: Path, samples: int) -> list[dict]:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["run"] == str(run) and [s["step"] for s in report["steps"]] == [1]
    step = report["steps"][0]
    assert step["samples"] == samples and step["metrics"]["reward/scored"] == samples
    dumped = [json.loads(line) for line in (run / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumped) == samples and all(d["reward"] is not None and d["tokens"] for d in dumped)
    assert step["metrics"]["rollout/reward_mean"] == pytest.approx(sum(d["reward"] for d in dumped) / samples)
    # generation only: no trainer rank ran, nothing was checkpointed
    assert not (run / "checkpoints").exists() and not list((run / "logs").glob("trainer*"))
    assert (run / "logs" / "router.log").is_file()
    return dumped


@pytest.mark.slow
def test_rollout_of_the_arithmetic_example(tiny_dense: Path, tmp_path: Path) -> None:
    out = _rollout("examples/arithmetic/config.yaml", f"model.name={tiny_dense}", f"run.output_dir={tmp_path}",
                   "run.dump_tokens=true", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                   "rollout.max_new_tokens=8")
    dumped = _check_run(out, tmp_path / "arithmetic", 4)
    assert all(d["weight_versions"] == [0] for d in dumped)  # the base model's weights, never updated
    assert {d["reward"] for d in dumped} <= {0.0, 1.0}  # exact_match, the example's reward


@pytest.mark.slow
def test_rollout_of_the_calculator_agent_example(tiny_dense: Path, tmp_path: Path) -> None:
    out = _rollout("examples/calculator_agent/config.yaml", f"model.name={tiny_dense}", f"run.output_dir={tmp_path}",
                   "run.dump_tokens=true", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2",
                   "rollout.max_new_tokens=12", "rollout.max_turns=2")
    dumped = _check_run(out, tmp_path / "calculator_agent", 2)
    assert (tmp_path / "calculator_agent" / "logs" / "session.log").is_file()  # the agent talked to the session server
    assert all(d["status"] in ("completed", "truncated") and sum(d["loss_mask"]) > 0 for d in dumped)
