"""The fsdp backend on CUDA: bf16 compute with fp32 master weights (skipped without a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from miles_contracts.testing.backend import make_test_batch, plain_logprobs


@pytest.mark.gpu
def test_bf16_backend_scores_and_trains(tiny_dense, make_config) -> None:
    from miles.context import context_for
    from miles.sections import ModelSection
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend

    config = make_config(tiny_dense)
    config = replace(config, model=ModelSection(name=str(tiny_dense), device="cuda"))
    backend = FSDPBackend(context_for(config, Process.trainer_rank(0)))
    try:
        assert backend.precision.compute == torch.bfloat16 and backend.precision.param == torch.float32
        batch = make_test_batch(tiny_dense)
        logprobs = backend.compute_logprobs(batch)
        assert logprobs.device.type == "cpu"
        torch.testing.assert_close(logprobs, plain_logprobs(tiny_dense, batch), rtol=0, atol=0.1)
        advantages = torch.where(batch.loss_mask > 0, torch.ones_like(logprobs), torch.zeros_like(logprobs))
        step = replace(batch, old_logprobs=logprobs, advantages=advantages)
        first, second = backend.train_step(step), backend.train_step(step)
        assert second["loss"] < first["loss"]
        weights = dict(backend.named_weights())
        assert all(t.dtype == torch.bfloat16 and t.is_cuda for t in weights.values())
    finally:
        backend.close()


@pytest.mark.gpu
def test_bench_runs_on_cuda_at_tiny_size() -> None:
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "bench", "train", "--tiny", "--device", "cuda"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    report = json.loads(out[out.index("{"):])
    assert report["dtype"].startswith("bf16") and all(r["miles"]["tokens_per_s"] > 0 for r in report["results"])


@pytest.mark.gpu
def test_compiled_head_and_cudnn_preference_match_eager_on_cuda(tiny_dense, make_config) -> None:
    """``fsdp.compile`` (layers and head) and ``fsdp.sdpa_backends`` change kernels, not results (bf16 rounding aside)."""
    from miles.context import context_for
    from miles.sections import ModelSection
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend

    batch = make_test_batch(tiny_dense)
    results = []
    for fsdp in ({"compile": False}, {"compile": True, "sdpa_backends": ["cudnn", "flash", "efficient", "math"]}):
        config = make_config(tiny_dense, fsdp=fsdp)
        config = replace(config, model=ModelSection(name=str(tiny_dense), device="cuda"))
        backend = FSDPBackend(context_for(config, Process.trainer_rank(0)))
        try:
            assert backend.compiled is fsdp["compile"]
            logprobs, entropy = backend.compute_logprobs_and_entropy(batch)
            advantages = torch.where(batch.loss_mask > 0, torch.ones_like(logprobs), torch.zeros_like(logprobs))
            metrics = backend.train_step(replace(batch, old_logprobs=logprobs, advantages=advantages))
            results.append((logprobs, entropy, metrics["grad_norm"]))
        finally:
            backend.close()
    (lp0, ent0, norm0), (lp1, ent1, norm1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=0.05)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=0.05)
    assert norm1 == pytest.approx(norm0, rel=0.05)
