"""``miles train`` on a verifiers environment, end to end on CPU with the tiny random model: the
``verifiers`` data source, agent (the environment's own rollout through the session server) and
reward (its rubric), the real engine, router, session server and FSDP trainer."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_one_step_on_the_single_turn_environment(tiny_dense: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli.main", "train", "packages/miles-verifiers/config.yaml",
         f"model.name={tiny_dense}", f"run.output_dir={tmp_path}", "run.steps=1", "run.dump_tokens=true",
         "verifiers.environment=miles_verifiers.demo_envs.sum_single_turn", "verifiers.args={}",
         "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "verifiers_tools"
    [metrics] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and metrics["rollout/samples"] == 4
    # the rubric scored every episode (0 or 1: the tiny model rarely adds right), and it trained
    assert all(s["reward"] in (0.0, 1.0) for s in samples)
    assert all(s["metadata"]["agent_result"]["turns"] == 1 and s["metadata"]["verifiers"]["answer"] for s in samples)
    assert all(sum(s["loss_mask"]) > 0 for s in samples) and math.isfinite(metrics["train/loss"])
    assert {s["label"] for s in samples} == {s["metadata"]["verifiers"]["answer"] for s in samples}
