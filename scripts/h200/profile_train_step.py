"""Where an RL-shaped training step goes on the GPU (the learning test's shape, random weights).

    python scripts/h200/profile_train_step.py --config .benchcfg --out DIR

256 rows of 40-80 tokens (the learning test: ~45-token prompts, up to 32 new tokens), one
``train_step`` of the fsdp backend per variant (packing, attention kernels, compile), timed over
5 steps after 3 warm-up ones; for the first variant also a torch.profiler table of the top ops.
First, bf16 forwards of a padded [256, 50] batch like the engine's batched prefill, with and
without the padding mask and with each attention kernel. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def make_batch(vocab: int, rows: int = 256, seed: int = 0):
    from miles_contracts import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 81, (rows,), generator=gen)
    width = int(lengths.max())
    tokens = torch.randint(0, vocab, (rows, width), generator=gen)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    loss_mask = attention.clone().float()
    loss_mask[:, :40] = 0  # the prompt
    advantages = torch.randn(rows, 1, generator=gen) * loss_mask
    return TrainBatch(tokens=tokens * attention, attention_mask=attention, loss_mask=loss_mask,
                      rollout_logprobs=torch.zeros(rows, width), rewards=torch.zeros(rows),
                      group_ids=torch.arange(rows) // 8, rollout_ids=torch.arange(rows), advantages=advantages)


def run(config_dir: Path, fsdp: dict, batch, profile_to: Path | None) -> dict:
    from miles.config import MilesConfig
    from miles.context import context_for
    from miles.sections import ModelSection, RunSection, TrainSection
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="sdpa")
    config = MilesConfig(model=ModelSection(device="cuda"), run=RunSection(steps=100),
                         train=TrainSection(lr=1e-6, micro_batch_tokens=16384), extra={"fsdp": FSDPSection(**fsdp)})
    backend = FSDPBackend(context_for(config, Process.trainer_rank(0)), actor=model)
    try:
        for _ in range(3):
            backend.train_step(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            backend.train_step(batch)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 5
        if profile_to is not None:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                backend.train_step(batch)
                torch.cuda.synchronize()
            profile_to.write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
                + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
            )
        return {"fsdp": fsdp, "step_s": seconds}
    finally:
        backend.close()


def prefill_forwards(config_dir: Path) -> list[dict]:
    """bf16 no-grad forwards of a padded [256, 50] batch (the engine's batched prefill shape)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(30, 51, (256,), generator=gen)
    ids = torch.randint(0, hf_config.vocab_size, (256, 50), generator=gen).cuda()
    mask = (torch.arange(50)[None, :] < lengths[:, None]).long().cuda()
    out = []
    for name, kwargs, backends in [
        ("mask", {"attention_mask": mask}, None), ("no_mask", {}, None),
        ("mask_efficient_only", {"attention_mask": mask}, [SDPBackend.EFFICIENT_ATTENTION]),
        ("mask_math_only", {"attention_mask": mask}, [SDPBackend.MATH]),
        ("mask_cudnn_first", {"attention_mask": mask}, [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]),
    ]:
        def step(kwargs: dict = kwargs, backends: list | None = backends) -> None:
            with torch.no_grad():
                if backends is None:
                    model(input_ids=ids, use_cache=False, **kwargs)
                else:
                    with sdpa_kernel(backends):
                        model(input_ids=ids, use_cache=False, **kwargs)
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                step()
            cpu = (time.perf_counter() - start) / 10
            torch.cuda.synchronize()
            out.append({"variant": name, "ms": (time.perf_counter() - start) / 10 * 1e3, "cpu_issue_ms": cpu * 1e3})
        except Exception as exc:  # noqa: BLE001
            out.append({"variant": name, "error": repr(exc)[:300]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    (args.out / "prefill_forwards.json").write_text(json.dumps(prefill_forwards(args.config), indent=2))
    batch = make_batch(AutoConfig.from_pretrained(args.config).vocab_size)
    eager = {"compile": False}  # compile is the CUDA default; the measured variants were eager
    variants = [
        eager, {**eager, "packing": False}, {**eager, "sdpa_backends": ["cudnn", "flash", "efficient", "math"]},
        {**eager, "sdpa_backends": ["math"]}, {"compile": True},
    ]
    results = []
    for index, fsdp in enumerate(variants):
        try:
            results.append(run(args.config, fsdp, batch, args.out / "profile_default.txt" if index == 0 else None))
        except Exception as exc:  # noqa: BLE001 - report and go on to the next variant
            results.append({"fsdp": fsdp, "error": repr(exc)[:300]})
        print(json.dumps(results[-1]), flush=True)
    (args.out / "train_step_variants.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
