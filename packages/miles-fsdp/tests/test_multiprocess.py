"""The fsdp backend on two processes (gloo, CPU): same results as one process, no hang when idle.

Each rank is a real ``python`` process running ``dist_worker.py``; they meet through a rendezvous
file. The parent compares both ranks' outputs with each other and with a one-process backend.
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


def _run_ranks(models: list[Path], out: Path, world: int = 2, conformance: bool = False) -> list[list[dict]]:
    """``results[model][rank]`` from ``world`` worker processes (one launch for all models)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    store = out / "rendezvous"
    cmd = [sys.executable, str(WORKER), "--world", str(world), "--store", str(store), "--models", ",".join(map(str, models)),
           "--out", str(out)] + (["--conformance"] if conformance else [])
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed (exit {p.returncode}):\n{log[-4000:]}"
    return [[torch.load(out / f"rank_{r}_model_{m}.pt", weights_only=False) for r in range(world)] for m in range(len(models))]


@pytest.fixture(scope="module")
def two_ranks(tiny_dense, tiny_moe, tmp_path_factory) -> dict[str, list[dict]]:
    """Both tiny models on two ranks, the conformance suite on the dense one."""
    dense, moe = _run_ranks([tiny_dense, tiny_moe], tmp_path_factory.mktemp("ranks"), conformance=True)
    return {"dense": dense, "moe": moe}


def _check_against_one_process(model_dir: Path, ranks: list[dict], backend_factory) -> None:
    from dataclasses import replace

    from miles_algorithms import objective

    batch = make_test_batch(model_dir)
    for r in ranks:  # every rank returns the full result
        assert torch.equal(r["logprobs"], ranks[0]["logprobs"]) and torch.equal(r["entropy"], ranks[0]["entropy"])
    torch.testing.assert_close(ranks[0]["logprobs"], plain_logprobs(model_dir, batch), rtol=0, atol=1e-4)

    single = backend_factory(model_dir, micro_batch_tokens=20)
    old = single.compute_logprobs(batch)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(old), torch.zeros_like(old))
    params = single.config.algorithm
    policy_loss = single.kernel.policy_losses().get("ppo_clip").loss
    correction = single.kernel.mismatch_corrections().get("none").correct
    single.runner.accumulate(
        "train", single.actor, objective.prepare_batch(replace(batch, advantages=advantages, old_logprobs=old)),
        lambda micro, out: objective.actor_loss(out[0], micro, params, policy_loss=policy_loss, correction=correction),
    )
    for name, p in single.actor.hf.named_parameters():
        want = p.grad.full_tensor()
        for r in ranks:
            torch.testing.assert_close(r["gradients"][name], want, rtol=1e-4, atol=1e-6, msg=f"rank {r['rank']} {name}")
    single.actor.zero_grad(set_to_none=True)
    metrics = single.train_step(replace(batch, advantages=advantages, old_logprobs=old))
    for r in ranks:  # the gradient norm is over all shards, the loss over all ranks' micro-batches
        for key in ("loss", "grad_norm", "entropy", "train_rollout_logprob_abs_diff"):
            assert r["step_metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key

    one_row = make_test_batch(model_dir, lengths=(9,))
    torch.testing.assert_close(ranks[0]["single_logprobs"], plain_logprobs(model_dir, one_row), rtol=0, atol=1e-4)
    for r in ranks:
        assert r["single_losses"] == ranks[0]["single_losses"] and r["single_losses"][1] < r["single_losses"][0]


@pytest.mark.slow
def test_two_ranks_dense_match_one_process_and_conform(tiny_dense, two_ranks, backend_factory) -> None:
    _check_against_one_process(tiny_dense, two_ranks["dense"], backend_factory)
    assert all(r["conformance"]["loss_after"] < r["conformance"]["loss_before"] for r in two_ranks["dense"])


@pytest.mark.slow
def test_two_ranks_moe_match_one_process(tiny_moe, two_ranks, backend_factory) -> None:
    _check_against_one_process(tiny_moe, two_ranks["moe"], backend_factory)
