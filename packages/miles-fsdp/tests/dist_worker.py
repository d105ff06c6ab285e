"""One rank of the multi-process tests (run by test_multiprocess.py, two processes over gloo).

Every rank runs the same scenarios on the same inputs (the backend is SPMD) and writes what it
saw to ``<out>/rank_<r>.pt``; the parent test compares ranks with each other and with a
single-process run.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist


def _trainable(batch, backend):
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(batch.loss_mask), torch.zeros_like(batch.loss_mask))
    return replace(batch, advantages=advantages, old_logprobs=backend.compute_logprobs(batch))


def _gradients(backend, batch):
    from miles_algorithms import objective

    params = backend.config.algorithm
    policy_loss = backend.kernel.policy_losses().get("ppo_clip").loss
    correction = backend.kernel.mismatch_corrections().get("none").correct

    def loss_fn(micro, outputs):
        return objective.actor_loss(outputs[0], micro, params, policy_loss=policy_loss, correction=correction)

    backend.runner.accumulate("train", backend.actor, objective.prepare_batch(batch), loss_fn)
    grads = {n: p.grad.full_tensor().clone() for n, p in backend.actor.hf.named_parameters()}
    backend.actor.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="file for the gloo rendezvous")
    parser.add_argument("--models", required=True, help="comma-separated model folders, run one after the other")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--conformance", action="store_true", help="also run the conformance suite on the first model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)

    args.out.mkdir(parents=True, exist_ok=True)
    for index, model in enumerate(args.models.split(",")):
        result = _scenarios(Path(model), rank=args.rank, conformance=args.conformance and index == 0, out=args.out)
        torch.save(result, args.out / f"rank_{args.rank}_model_{index}.pt")
    dist.destroy_process_group()


def _scenarios(model_dir: Path, *, rank: int, conformance: bool, out: Path) -> dict:
    from miles.config import MilesConfig
    from miles.context import context_for
    from miles.sections import ModelSection, TrainSection
    from miles_contracts import Process
    from miles_contracts.testing.backend import check_train_backend, make_test_batch
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection

    config = MilesConfig(model=ModelSection(name=str(model_dir), device="cpu"),
                         train=TrainSection(lr=1e-3, micro_batch_tokens=20), extra={"fsdp": FSDPSection()})
    ctx = context_for(config, Process.trainer_rank(rank))

    result: dict = {"rank": rank}
    backend = FSDPBackend(ctx)
    batch = make_test_batch(model_dir)
    result["logprobs"], result["entropy"] = backend.compute_logprobs_and_entropy(batch)
    # one row on two ranks: rank 1 has nothing to do and must still keep FSDP in lockstep
    single = make_test_batch(model_dir, lengths=(9,))
    result["single_logprobs"] = backend.compute_logprobs(single)
    trainable = _trainable(batch, backend)
    result["gradients"] = _gradients(backend, trainable)
    result["step_metrics"] = backend.train_step(trainable)

    step = _trainable(single, backend)
    result["single_losses"] = [backend.train_step(step)["loss"], backend.train_step(step)["loss"]]
    backend.close()

    if conformance:
        bridge = ctx.kernel.model_bridge(json.loads((model_dir / "config.json").read_text()))
        report = check_train_backend(lambda: FSDPBackend(ctx), model_dir, work_dir=out / "conformance", bridge=bridge)
        result["conformance"] = {"loss_before": report.loss_before, "loss_after": report.loss_after}
    return result


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
