"""Arguments of ``miles bench train`` (the measuring lives in :mod:`miles_fsdp.bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from miles.cli import emit_json
from miles.errors import MilesError
from miles_contracts import CommandSpec, LoRASpec, RunContext


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-0.6b", help="random-weight preset: qwen3-0.6b, qwen3-8b, llama-1b, smollm2-135m, tiny")
    p.add_argument("--tiny", action="store_true", help="CPU-sized run: tiny model, 128/256-token sequences, 2 steps")
    p.add_argument("--seq-lens", default="4096,16384", help="comma-separated tokens per sequence")
    p.add_argument("--tokens-per-step", type=int, default=65536, help="tokens per optimiser step (rows = this / seq len)")
    p.add_argument("--length-spread", type=float, default=0.0, metavar="F",
                   help="rows of varied length, uniform in [(1 - F) * L, L] (RL-like; 0 = every row L tokens)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocator, autotuning, compile)")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    compiling = p.add_mutually_exclusive_group()
    compiling.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                           help="torch.compile decoder layers and the log-prob head (the default on CUDA)")
    compiling.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                           help="eager decoder layers and head (the default on CPU)")
    p.add_argument("--compile-head", action="store_true", help="torch.compile only the log-prob head's per-chunk maths")
    p.add_argument("--sdpa-backends", default=None,
                   help="attention kernels in order of preference, comma-separated: cudnn, flash, efficient, math")
    p.add_argument("--logprob-chunk", type=int, default=4096, help="positions per log-prob chunk")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain transformers baseline")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also measure the step with LoRA adapters of this rank on every projection (train.lora)")
    p.add_argument("--true-on-policy", action="store_true",
                   help="also measure the fsdp step with rollout.true_on_policy (the batch-invariant forward) and "
                        "the on/off step-time ratio")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --true-on-policy: pairs of the default and the true on-policy step, alternating (>= 3 "
                        "for a published figure; the median ratio is reported with its spread)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="train.micro_batch_tokens (default: the sequence length, one row per micro-batch)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak; default 989 on CUDA, measured on CPU")
    p.add_argument("--backend", default="fsdp", help="registered train backend to measure (fsdp, megatron, ...)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the backend's config section, e.g. --option tensor_parallel=2 (repeatable)")
    p.add_argument("--work-dir", type=Path, default=None, help="where a non-fsdp backend's random checkpoint is written")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    tree = p.add_argument_group("prefix trees (--tree)")
    tree.add_argument("--tree", action="store_true",
                      help="flat rows vs prefix trees on a GRPO group and on branched agent episodes "
                           "(--steps = timed repeats, >= 3); with --tiny: the tiny model at 1/8 of the lengths")
    tree.add_argument("--tree-attention", default=None,
                      help="attention implementations to run the trees with, comma-separated (sdpa, flex_attention); "
                           "default sdpa,flex_attention on CUDA, sdpa on CPU (flex has no CPU backward)")
    tree.add_argument("--tree-scale", type=float, default=None,
                      help="multiply every workload length by this (default 1: a 2K-token prompt + 8 x 256)")
    tree.add_argument("--tree-workloads", default="grpo,episodes", help="comma-separated: grpo, episodes")
    tree.add_argument("--tree-groups", type=int, default=1,
                      help="GRPO groups in the grpo workload's step (each its own prompt); the micro-batch budget "
                           "is --micro-batch-tokens, default one group's flat size")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after the timed steps, one more under torch.profiler per length: op tables to DIR")


def _fsdp_options(args: argparse.Namespace) -> dict:
    options: dict = {"logprob_chunk_size": args.logprob_chunk}
    if args.compile is not None:
        options["compile"] = args.compile
    if args.compile_head:
        options["compile_head"] = True
    if args.sdpa_backends:
        options["sdpa_backends"] = [name.strip() for name in args.sdpa_backends.split(",") if name.strip()]
    _fsdp_options_valid(options, "benchmark options")
    return options


def _fsdp_options_valid(options: dict, what: str) -> None:
    from pydantic import ValidationError

    from miles_fsdp.config import FSDPSection

    try:
        FSDPSection(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise MilesError(f"bad {what}: {problems}") from None


def _section_options(args: argparse.Namespace, ctx: RunContext) -> dict:
    """``--option key=value`` pairs as the backend's config section (YAML scalars)."""
    import yaml
    from pydantic import ValidationError

    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise MilesError(f"--option wants KEY=VALUE, got {item!r}")
        options[key.strip()] = yaml.safe_load(value)
    sections = ctx.kernel.config_sections()
    if args.backend not in sections.names():
        raise MilesError(f"train backend {args.backend!r} registers no config section; known: {', '.join(sections.names())}")
    try:
        sections.get(args.backend).model(**options)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise MilesError(f"bad --option for {args.backend}: {problems}") from None
    return options


def _lora(rank: int) -> LoRASpec | None:
    if rank < 0:
        raise MilesError(f"--lora-rank must be 0 (off) or a positive rank, got {rank}")
    return LoRASpec(rank=rank, alpha=2.0 * rank) if rank else None



def _run_tree(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_fsdp.bench_tree import run_tree_benchmark

    if args.tiny:
        args.model, args.steps, args.warmup = "tiny", max(args.steps, 3), 1
    scale = args.tree_scale if args.tree_scale is not None else (0.125 if args.tiny else 1.0)
    if not 0.0 < scale <= 4.0:
        raise MilesError(f"--tree-scale must be in (0, 4], got {scale}")
    workloads = [w.strip() for w in args.tree_workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - {"grpo", "episodes"})
    if unknown or not workloads:
        raise MilesError(f"--tree-workloads: unknown {unknown or 'empty list'}; choose from grpo, episodes")
    from miles.trainer.device import pick_device

    cuda = pick_device(args.device).type == "cuda"
    attentions = ([a.strip() for a in args.tree_attention.split(",") if a.strip()] if args.tree_attention
                  else ["sdpa", "flex_attention"] if cuda else ["sdpa"])
    options = _fsdp_options(args)
    for attention in attentions:
        _fsdp_options_valid({**options, "prefix_tree": "on", "attn_implementation": attention}, "--tree-attention")
    if args.steps < 3:
        raise MilesError(f"--tree times >= 3 repeats: --steps {args.steps} is too few")
    if not 1 <= args.tree_groups <= 256:
        raise MilesError(f"--tree-groups must be in [1, 256], got {args.tree_groups}")
    report = run_tree_benchmark(ctx=ctx, preset=args.model, device=args.device, options=options, attentions=attentions,
                                warmup=max(1, args.warmup), repeats=args.steps, scale=scale, workloads=workloads,
                                groups=args.tree_groups, micro_batch_tokens=args.micro_batch_tokens)
    emit_json(report, args.output)
    return 0


def _run(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_fsdp.bench import PRESETS, run_benchmark

    if args.model not in PRESETS and not args.tiny:
        raise MilesError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)}")
    if args.tree:
        return _run_tree(args, ctx)
    if args.tiny:
        args.model, args.seq_lens, args.tokens_per_step, args.steps, args.warmup = "tiny", "128,256", 512, 2, 1
    if args.model not in PRESETS:
        raise MilesError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)}")
    try:
        seq_lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    except ValueError:
        raise MilesError(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}") from None
    if not seq_lens or min(seq_lens) < 2:
        raise MilesError("--seq-lens needs at least one length >= 2")
    if not 0.0 <= args.length_spread < 1.0:
        raise MilesError(f"--length-spread must be in [0, 1), got {args.length_spread}")
    if args.repeats < 1:
        raise MilesError(f"--repeats must be at least 1, got {args.repeats}")
    fsdp = args.backend == "fsdp"
    report = run_benchmark(
        ctx=ctx, preset=args.model, seq_lens=seq_lens, tokens_per_step=args.tokens_per_step, warmup=args.warmup,
        steps=args.steps, device=args.device, gradient_checkpointing=args.gradient_checkpointing,
        options=_fsdp_options(args) if fsdp else _section_options(args, ctx), baseline=not args.no_baseline,
        peak_tflops=args.peak_tflops, micro_batch_tokens=args.micro_batch_tokens, backend=args.backend,
        section=None if fsdp else args.backend, work_dir=args.work_dir, profile_dir=args.profile,
        length_spread=args.length_spread, lora=_lora(args.lora_rank), true_on_policy=args.true_on_policy,
        repeats=args.repeats,
    )
    import os

    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank measures, rank 0 reports
        emit_json(report, args.output)
    return 0


BENCH_TRAIN = CommandSpec(
    "tokens/s and MFU of an fsdp training step (bf16 on CUDA) against a plain transformers loop",
    _run,
    add_arguments=_add_arguments,
    description=(
        "Trains a random-weight model (default: a Qwen3-0.6B config) on full random sequences of each --seq-lens "
        "length and prints JSON: step time, tokens/s, TFLOP/s and MFU for the fsdp backend and for a plain "
        "transformers loop measured in the same run. FLOPs = 6 * matmul params * L + 6 * layers * heads * head_dim "
        "* L^2 per sequence."
    ),
)
