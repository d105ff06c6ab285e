"""`miles train` with ``train.lora`` end to end on CPU (tiny random model): the fsdp backend trains
adapters, every weight sync carries the adapters only and is checked bit-exact on the engine, the
engine's log-probs match the trainer's (the engine applies the adapters), the KL reference is the
base, and the final export holds merged weights plus a PEFT adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lora_run_syncs_adapters_only_and_exports(tmp_path: Path) -> None:
    from miles_models.testing import tiny_model

    model = tiny_model("dense")
    args = [
        f"model.name={model}", f"run.output_dir={tmp_path}", "run.name=lora", "run.steps=2", "run.export_hf=true",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
        "rollout.filters=[no_aborted]", "reward.name=f1", "data.options={digits: 1}", "weights.check=true",
        "train.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "train.lr=1e-3",
        "train.use_reference=true", "algorithm.kl_loss_coef=0.1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    assert [m["weights/check_passed"] for m in metrics] == [1.0, 1.0]
    # 2 layers x (q_proj, v_proj) x (A [4, 64] + B [out, 4]) in fp32: a few KB, not the model's 13 MB
    assert all(m["weights/sync_bytes"] < 100_000 for m in metrics), [m["weights/sync_bytes"] for m in metrics]
    for m in metrics:
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-3
    exported = sorted(p.relative_to(tmp_path / "lora") for p in (tmp_path / "lora").rglob("adapter_config.json"))
    assert exported, "no PEFT adapter was exported"
