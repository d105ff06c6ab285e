"""The megatron backend on two processes over gloo: TP=2 (sequence parallel; eager and with
torch.compile'd layers), PP=2, CP=2 on the tiny Llama and EP=2 on the tiny Qwen3-MoE give the
log-probs, gradients and step metrics of a one-process backend; the conformance suite passes at
TP=2, PP=2 and EP=2; a checkpoint saved at TP=2 resumes at TP=1 with the same next-step loss.

All layouts run in one launch of two ranks (``dist_worker.py``): starting a process that imports
torch and megatron-core costs more than the checks themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles_contracts.testing.backend import make_test_batch, plain_logprobs

WORKER = Path(__file__).with_name("dist_worker.py")
LAYOUTS = ("tp2", "tp2-compiled", "pp2", "cp2", "ep2")
LAUNCHED = (*LAYOUTS, "tp2-lora")  # every layout dist_worker.py runs


@pytest.fixture(scope="module")
def ranks(tiny_dense, tiny_moe, tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(WORKER), "--world", "2", "--store", str(out / "rendezvous"), "--dense", str(tiny_dense),
           "--moe", str(tiny_moe), "--out", str(out)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed (exit {p.returncode}):\n{log[-4000:]}"
    return {name: [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)] for name in LAUNCHED}


def _one_process(model_dir, backend_factory) -> dict:
    from dataclasses import replace

    from miles_megatron.testing import hf_gradients

    backend = backend_factory(model_dir, megatron={"distributed_optimizer": False, "moe_aux_loss_coef": 0.0})
    batch = make_test_batch(model_dir)
    logprobs, entropy = backend.compute_logprobs_and_entropy(batch)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(logprobs), torch.zeros_like(logprobs))
    trainable = replace(batch, advantages=advantages, old_logprobs=logprobs, rollout_logprobs=logprobs)
    grads = hf_gradients(backend, trainable)
    return {"logprobs": logprobs, "entropy": entropy, "gradients": grads, "metrics": backend.train_step(trainable)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(layout, ranks, tiny_dense, tiny_moe, backend_factory) -> None:
    model_dir = tiny_moe if layout == "ep2" else tiny_dense
    want = _one_process(model_dir, backend_factory)
    got = ranks[layout]
    # the layers went through torch.compile in the compiled layout only (CPU default: eager)
    assert all(set(r["compiled_layers"]) == {layout == "tp2-compiled"} for r in got)
    for r in got:  # every rank returns the full result
        torch.testing.assert_close(r["logprobs"], want["logprobs"], rtol=0, atol=2e-5)
        torch.testing.assert_close(r["entropy"], want["entropy"], rtol=0, atol=2e-5)
        for key in ("loss", "grad_norm", "entropy", "train_rollout_logprob_abs_diff"):
            assert r["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(got[0]["logprobs"], plain_logprobs(model_dir, make_test_batch(model_dir)), rtol=0, atol=1e-4)
    assert got[0]["gradients"].keys() == want["gradients"].keys() and not got[1]["gradients"]  # rank 0 yields
    for name, grad in want["gradients"].items():
        torch.testing.assert_close(got[0]["gradients"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if layout in ("tp2", "pp2", "ep2"):  # the layouts that also ran the conformance suite
        assert all(r["conformance"]["loss_after"] < r["conformance"]["loss_before"] for r in got)


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_resumes_at_tp1(ranks) -> None:
    for r in ranks["tp2"]:
        assert r["tp1_next_loss"] == pytest.approx(r["tp2_next_loss"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_each_pipeline_stage_reads_only_its_layers_of_the_checkpoint(ranks) -> None:
    """The checkpoint streams in by layer: at PP=2 each stage reads the tensors outside the
    decoder layers (embeddings, final norm) and its own layer of the tiny model's two; at TP=2
    both ranks need every layer."""
    assert [r["layers_read"] for r in ranks["pp2"]] == [[None, 0], [None, 1]]
    assert [r["layers_read"] for r in ranks["tp2"]] == [[None, 0, 1]] * 2


@pytest.mark.slow
def test_lora_at_tp2_matches_one_process(ranks, tiny_dense, backend_factory) -> None:
    """Adapters on column-parallel (q, v, gate: A replicated, B split by rows) and row-parallel
    (o, down: A split by columns, B replicated) linears with sequence parallelism: log-probs,
    adapter gradients, step metrics and the trained adapters at TP=2 equal one process's."""
    from miles_megatron.testing import lora_steps, lora_train_settings

    backend = backend_factory(tiny_dense, megatron={"distributed_optimizer": False}, **lora_train_settings())
    want = lora_steps(backend, make_test_batch(tiny_dense))
    got = ranks["tp2-lora"]
    assert want["adapters"] and all(".lora_" in name for name in want["adapters"])
    assert got[0]["adapters"].keys() == want["adapters"].keys() and not got[1]["adapters"]  # rank 0 yields
    for name, tensor in want["adapters"].items():
        torch.testing.assert_close(got[0]["adapters"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert got[0]["gradients"].keys() == want["gradients"].keys()
    for name, grad in want["gradients"].items():
        assert grad.abs().sum() > 0, name  # after a step every adapter (A too) gets a gradient
        torch.testing.assert_close(got[0]["gradients"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    for r in got:
        torch.testing.assert_close(r["logprobs"], want["logprobs"], rtol=0, atol=2e-5)
        for key in ("loss", "grad_norm"):
            assert r["first"][key] == pytest.approx(want["first"][key], rel=1e-4, abs=1e-6), key
            assert r["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key
