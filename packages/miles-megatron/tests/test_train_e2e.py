"""`miles train train.backend=megatron` end to end on CPU with the tiny random Llama: the real
engine, router, megatron backend in trainer rank processes (one; or two at TP=2, the trainer-ranks
handle of the loop), weight sync in check mode and a checkpoint, as the local executor starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["resources.trainer_ranks=2", "megatron.tensor_parallel=2"]], ids=["one-rank", "tp2"])
def test_train_with_the_megatron_backend(tiny_dense: Path, tmp_path: Path, layout: list[str]) -> None:
    args = [*layout, 
        f"model.name={tiny_dense}", f"run.output_dir={tmp_path}", "run.name=mg", "run.steps=2",
        "train.backend=megatron", "weights.check=true", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=12", "reward.name=f1", "data.options={digits: 1}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args], capture_output=True, text=True,
                         timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    run = tmp_path / "mg"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # fp32 engine vs fp32 megatron trainer on the same weights: log-probs agree to rounding
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert m["train/optimizer_steps"] >= 1
    assert [m["weights/version"] for m in metrics] == [1.0, 2.0]
    assert [m["weights/check_passed"] for m in metrics] == [1.0, 1.0]
    assert (run / "checkpoints" / "step_000002" / "miles-state.json").is_file()
    assert "run completed" in out.stderr
    # the ranks split the model as asked (not, say, two data-parallel replicas)
    trainer_state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert ("tp=2" if layout else "tp=1") in trainer_state["layout"]
    services = json.loads((run / "services.json").read_text())
    ranks = 2 if layout else 1
    assert [s["name"] for s in services if s["name"].startswith("trainer")] == [f"trainer-{r}" for r in range(ranks)]
