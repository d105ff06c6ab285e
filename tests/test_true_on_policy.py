"""`rollout.true_on_policy` end to end: `miles train` (sync, temperature 0.8) on the tiny dense
model, a reward that moves the weights every step (so steps 2 and 3 sample with freshly synced
weights), 6 concurrent samples whose decode batch shrinks as they finish: every trainable token's trainer log-prob equals
the rollout's exactly (the metric is 0.0 and the check, in `error` mode, counted no mismatch). The
config errors are checked without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.slow
def test_true_on_policy_run_has_zero_diff_on_every_token(tiny_dense: Path, tmp_path: Path, vowel_reward: str) -> None:
    out = _train(f"model.name={tiny_dense}", f"run.output_dir={tmp_path}", "run.name=top", "run.steps=3",
                 "run.dump_tokens=true", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3",
                 "rollout.max_new_tokens=8", "rollout.temperature=0.8", "rollout.true_on_policy=true", "reward.name=remote",
                 f"reward.remote_url={vowel_reward}", "train.lr=1e-3", "data.options={digits: 1}")
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    run = tmp_path / "top"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["train/train_rollout_logprob_abs_diff"] == 0.0
        assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert m["train/true_on_policy_mismatched_tokens"] == 0.0
        assert m["train/true_on_policy_checked_tokens"] > 0
        assert m["train/grad_norm"] > 0  # the weights moved: steps 2 and 3 sample with updated weights
    for step in (1, 2, 3):
        samples = [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 6
        assert {tuple(s["weight_versions"]) for s in samples} == {(step - 1,)}


def test_true_on_policy_config_errors_name_every_incompatible_key(tmp_path: Path) -> None:
    from miles.config import load_config

    with pytest.raises(Exception) as raised:
        load_config(None, ["rollout.true_on_policy=true", "rollout.engine=sglang", "train.backend=megatron",
                           "model.dtype=bfloat16", "rollout.top_p=0.9", f"run.output_dir={tmp_path}"])
    message = str(raised.value)
    for key in ("rollout.engine", "train.backend", "model.dtype", "rollout.top_p"):
        assert key in message, message
