"""One rank of the two-rank tests (run by test_multirank.py: two processes over gloo).

One launch runs every layout one after the other (megatron-core's parallel state is torn down
between them), because starting a process that imports torch and megatron-core costs more than
the checks: TP=2 (with sequence parallelism; eager and with compiled layers), PP=2, CP=2 on the
tiny Llama, EP=2 on the tiny Qwen3-MoE. Each writes what it saw to ``<out>/<layout>_rank<r>.pt`` for the parent to compare
with a one-process backend.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {
    "tp2": ("dense", {"tensor_parallel": 2}),
    "pp2": ("dense", {"pipeline_parallel": 2}),
    "cp2": ("dense", {"context_parallel": 2}),
    "ep2": ("moe", {"expert_parallel": 2}),
    # torch.compile'd layers (the CUDA default) with TP=2 + sequence parallelism: the collectives inside
    "tp2-compiled": ("dense", {"tensor_parallel": 2, "compile_layers": True}),
    # LoRA adapters on the column- and row-parallel linears, sequence parallel (testing.lora_steps)
    "tp2-lora": ("dense", {"tensor_parallel": 2}),
}
CONFORMANCE = {"tp2", "pp2", "ep2"}


def _trainable(batch, logprobs):
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(batch.loss_mask), torch.zeros_like(batch.loss_mask))
    return replace(batch, advantages=advantages, old_logprobs=logprobs, rollout_logprobs=logprobs)


def _context(model_dir: Path, train: dict | None = None, **megatron):
    """This rank's context for a CPU config of ``model_dir`` with the ``megatron`` options."""
    from miles.context import context_for
    from miles_contracts import Process
    from miles_megatron.testing import config_for

    return context_for(config_for(model_dir, megatron=megatron, **(train or {})), Process.trainer_rank(dist.get_rank()))


def _scenario(name: str, model_dir: Path, layout: dict, out: Path) -> dict:
    from miles_contracts.testing.backend import check_train_backend, make_test_batch
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.testing import hf_gradients

    if name == "tp2-lora":
        from miles_megatron.testing import lora_steps, lora_train_settings

        backend = MegatronBackend(_context(model_dir, lora_train_settings(),
                                           **{**layout, "distributed_optimizer": False}))
        result = lora_steps(backend, make_test_batch(model_dir))
        backend.close()
        return result
    result: dict = {}
    # the router's load-balancing loss is a function of each micro-batch's own tokens, so it (alone)
    # differs between layouts: off for the comparison, on (the model's) in the conformance run
    exact = {"distributed_optimizer": False, "moe_aux_loss_coef": 0.0}
    backend = MegatronBackend(_context(model_dir, **{**layout, **exact}))
    batch = make_test_batch(model_dir)
    result["layers_read"] = backend.layers_read
    result["compiled_layers"] = [getattr(layer, "_compiled_call_impl", None) is not None
                                 for chunk in backend.actor.chunks for layer in chunk.decoder.layers]
    result["logprobs"], result["entropy"] = backend.compute_logprobs_and_entropy(batch)
    trainable = _trainable(batch, result["logprobs"])
    result["gradients"] = hf_gradients(backend, trainable)
    result["metrics"] = backend.train_step(trainable)
    if name == "tp2":
        result.update(_resume_at_tp1(backend, model_dir, batch, out))
    backend.close()
    if name in CONFORMANCE:
        ctx = _context(model_dir, **layout)
        bridge = ctx.kernel.model_bridge(json.loads((model_dir / "config.json").read_text()))
        report = check_train_backend(lambda: MegatronBackend(ctx), model_dir,
                                     work_dir=out / f"conformance_{name}", bridge=bridge)
        result["conformance"] = {"loss_before": report.loss_before, "loss_after": report.loss_after}
    return result


def _resume_at_tp1(backend, model_dir: Path, batch, out: Path) -> dict:
    """Save at TP=2, then the next step's loss at TP=2 and, from the checkpoint, at TP=1 (DP=2)."""
    from miles_megatron.backend import MegatronBackend

    path = out / "tp2_checkpoint"
    backend.save_checkpoint(path, {"step": 1})
    step = _trainable(batch, backend.compute_logprobs(batch))
    step = replace(step, advantages=-step.advantages)
    losses = {"tp2_next_loss": backend.train_step(step)["loss"]}
    backend.close()
    resumed = MegatronBackend(_context(model_dir, distributed_optimizer=False))
    assert resumed.load_checkpoint(path) == {"step": 1}
    losses["tp1_next_loss"] = resumed.train_step(step)["loss"]
    resumed.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="file for the gloo rendezvous")
    parser.add_argument("--dense", type=Path, required=True)
    parser.add_argument("--moe", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", default=",".join(LAYOUTS), help="comma-separated layouts to run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world)
    models = {"dense": args.dense, "moe": args.moe}
    for name in args.only.split(","):
        kind, layout = LAYOUTS[name]
        result = _scenario(name, models[kind], layout, args.out)
        torch.save(result, args.out / f"{name}_rank{args.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
