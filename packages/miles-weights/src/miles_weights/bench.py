"""``miles bench weights``: GB/s of a full weight sync trainer -> engine, for each transport and
device, against the memory-copy limit measured in the same run on the same byte count.

::

    miles bench weights                                   # SmolLM2-135M; CPU, plus CUDA when present
    miles bench weights --devices cuda --random-model 8b  # a random 7.5 B Llama on the GPU(s)
    miles bench weights --lora-rank 32                    # also: adapter-only syncs vs full, same run

The trainer is this process: it holds the model's tensors (fp32 on CPU, bf16 on CUDA) and pushes
them with each registered transport into ``embedded`` engines started as child processes. The first
push of each transport runs in check mode (engine weights filled with noise, then restored
bit-exactly), then one warm-up push and ``--repeats`` timed pushes. A push is the whole sync: pause,
every bucket, flush, version bump, continue. Baselines: ``memcpy`` (CPU to CPU), ``device_copy``
(one GPU to itself), ``p2p_copy`` (GPU 0 to GPU 1). On CUDA, disk and shared_memory (CUDA IPC) use
an engine on the trainer's GPU; broadcast (NCCL) needs the engine on a second GPU, because NCCL
refuses two ranks on one device, and is skipped with a note when there is only one.

With ``--lora-rank R`` each transport is measured a second time, pushing only LoRA adapters of
rank R on every attention and MLP projection (what a ``train.lora`` run syncs) into engines that
serve them unmerged; the result gives bytes and seconds per sync of both, and full / LoRA ratios.

``broadcast`` is measured in each layout of ``--broadcast-formats``: ``broadcast`` is the default
(``flattened_bucket``, one collective per bucket), ``broadcast/per_tensor`` one collective per tensor.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.cli import emit_json
from miles.sections import WeightsSection

from miles_weights.settings import BROADCAST_LAYOUTS, WeightTransportSection, default_of, flag_help

if TYPE_CHECKING:
    from miles_contracts import RunContext

TRANSPORTS = ("disk", "shared_memory", "broadcast")
OPTIONAL_TRANSPORTS = ("mooncake",)  # measured by default when their package is installed


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's flags; those standing for config keys take their defaults, choices and help from
    the sections that declare the keys."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog name or model folder")
    p.add_argument("--random-model", choices=("0.6b", "1b", "8b"), help="instead: a random-weight Llama of this size (built once)")
    p.add_argument("--transports", default=None,
                   help=f"comma-separated registered transports (default: {', '.join(TRANSPORTS)}, and mooncake "
                   "when miles-mooncake is installed)")
    p.add_argument("--devices", default=None, help="cpu and/or cuda, comma-separated (default: cpu, and cuda when present)")
    p.add_argument("--broadcast-formats", default=",".join(BROADCAST_LAYOUTS),
                   help="comma-separated layouts the broadcast transport is measured in, each a value of "
                   + flag_help("weight_transport.broadcast_format", WeightTransportSection, "broadcast_format",
                               f" (choices: {', '.join(BROADCAST_LAYOUTS)})"))
    p.add_argument("--bucket-mb", type=int, default=default_of(WeightsSection, "bucket_mb"),
                   help=flag_help("weights.bucket_mb", WeightsSection, "bucket_mb", " (MiB per bucket)"))
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per transport")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also measure adapter-only syncs of this LoRA rank (q/k/v/o/gate/up/down projections)")
    p.add_argument("--work-dir", type=Path, default=None, help="engine logs and disk-transport files (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    """``miles bench weights``; the transports are the ones registered with ``ctx.kernel``."""
    import torch
    from miles_models import resolve_model

    from miles_weights.sync import TransportOptions

    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.lora_rank < 0:
        raise SystemExit("--lora-rank must be 0 (off) or a positive rank")
    try:
        TransportOptions(bucket_mb=args.bucket_mb)  # the bounds weights.bucket_mb has in a run
    except ValueError as exc:
        raise SystemExit(f"--bucket-mb: {exc}") from None
    devices = (args.devices or ("cpu,cuda" if torch.cuda.is_available() else "cpu")).split(",")
    unknown = [d for d in devices if d not in ("cpu", "cuda")]
    if unknown or ("cuda" in devices and not torch.cuda.is_available()):
        raise SystemExit(f"--devices takes cpu and/or cuda (cuda needs a GPU); got {args.devices!r}")
    names = args.transports.split(",") if args.transports else _default_transports(ctx)
    transports = _variants([t.strip() for t in names if t.strip()],
                           [f.strip() for f in args.broadcast_formats.split(",") if f.strip()])
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="miles-bench-weights-"))
    model_dir = Path(resolve_model(args.model, auto_pull=True))
    if args.random_model:
        from miles_models import miles_home

        from miles_weights.bench_models import random_llama

        model_dir = random_llama(args.random_model, model_dir, miles_home() / "bench")
    result: dict[str, Any] = {
        "benchmark": "weights",
        "command": shlex.join(["miles", *sys.argv[1:]]),
        "model": str(model_dir),
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "host": {"cpus": os.cpu_count(), "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "runs": [],
    }
    versions = count(1)
    for device in devices:
        result["runs"].append(_bench_device(ctx, device, transports, model_dir, work_dir / device, args, versions))
    emit_json(result, args.out)
    failed = any("error" in t for r in result["runs"] for t in r["transports"].values())
    return 1 if failed else 0


def _default_transports(ctx: RunContext) -> list[str]:
    registered = ctx.kernel.weight_transports().names()
    return [*TRANSPORTS, *(name for name in OPTIONAL_TRANSPORTS if name in registered)]


def _variants(names: list[str], broadcast_formats: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, transport, weight_transport overrides)`` for each measurement; a broadcast layout
    other than the section's default is labelled ``broadcast/<layout>``."""
    bad = [f for f in broadcast_formats if f not in BROADCAST_LAYOUTS]
    if bad or not broadcast_formats:
        raise SystemExit(f"--broadcast-formats takes {' and/or '.join(BROADCAST_LAYOUTS)}; "
                         f"got {','.join(broadcast_formats)!r}")
    default = default_of(WeightTransportSection, "broadcast_format")
    out: list[tuple[str, str, dict[str, Any]]] = []
    for name in names:
        if name != "broadcast":
            out.append((name, name, {}))
            continue
        for layout in broadcast_formats:
            label = name if layout == default else f"{name}/{layout}"
            out.append((label, name, {"broadcast_format": layout}))
    return out


def _visible_gpus() -> list[str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[: torch.cuda.device_count()]


def _bench_device(ctx: RunContext, device: str, transports: list[tuple[str, str, dict[str, Any]]], model_dir: Path, work_dir: Path,
                  args: argparse.Namespace, versions: count) -> dict[str, Any]:
    import torch

    from miles_weights.bench_baselines import copy_gbps
    from miles_weights.bench_models import load_tensors
    from miles_weights.launch import EngineLaunch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    trainer = "cpu" if device == "cpu" else "cuda:0"
    tensors = load_tensors(model_dir, dtype, trainer)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    dtype_name = str(dtype).removeprefix("torch.")
    gpus = _visible_gpus() if device == "cuda" else []
    small_kv = {"kv_cache_gb": 1.0}  # the engines only load weights here; leave the GPU memory to them
    if device == "cpu":
        baselines = {"memcpy": copy_gbps(num_bytes, "cpu", "cpu")}
        launches = [EngineLaunch("cpu", dtype_name, options=small_kv)]
    else:
        baselines = {"device_copy": copy_gbps(num_bytes, "cuda:0", "cuda:0")}
        launches = [EngineLaunch("cuda", dtype_name, {"CUDA_VISIBLE_DEVICES": gpus[0]}, small_kv)]
        if len(gpus) > 1:
            baselines["p2p_copy"] = copy_gbps(num_bytes, "cuda:0", "cuda:1")
            if any(name == "broadcast" for _, name, _ in transports):
                launches.append(EngineLaunch("cuda", dtype_name, {"CUDA_VISIBLE_DEVICES": gpus[1]}, small_kv))
    out: dict[str, Any] = {"device": device, "dtype": dtype_name, "num_tensors": len(tensors), "num_bytes": num_bytes,
                           "baselines_gbps": baselines, "transports": {}}
    work_dir.mkdir(parents=True, exist_ok=True)
    out["transports"] = _bench_engines(ctx, transports, model_dir, launches, tensors, baselines, work_dir, args, versions)
    if args.lora_rank:
        out["lora"] = _bench_lora(ctx, transports, model_dir, launches, tensors, baselines, out, work_dir, args, versions)
    return out


def _bench_lora(ctx: RunContext, transports: list[tuple[str, str, dict[str, Any]]], model_dir: Path,
                launches: list[Any], full: list, baselines: dict[str, float], measured_full: dict[str, Any],
                work_dir: Path, args: argparse.Namespace, versions: count) -> dict[str, Any]:
    """The same transports pushing adapters only, into engines that serve them; ratios to the full sync."""
    from dataclasses import replace

    from miles_contracts import LoRASpec

    from miles_weights.bench_models import adapter_tensors

    spec = LoRASpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    adapters = adapter_tensors(full, spec)
    num_bytes = sum(t.numel() * t.element_size() for _, t in adapters)
    lora_launches = [replace(launch, lora=spec.model_dump()) for launch in launches]
    measured = _bench_engines(ctx, transports, model_dir, lora_launches, adapters, baselines, work_dir / "lora", args,
                              versions)
    for label, result in measured.items():
        full_result = measured_full["transports"].get(label, {})
        if "seconds_median" in result and "seconds_median" in full_result:
            result["seconds_ratio_full_over_lora"] = full_result["seconds_median"] / result["seconds_median"]
    return {"rank": spec.rank, "target_modules": spec.target_modules, "num_tensors": len(adapters),
            "num_bytes": num_bytes, "bytes_ratio_full_over_lora": measured_full["num_bytes"] / num_bytes,
            "transports": measured}


def _bench_engines(ctx: RunContext, transports: list[tuple[str, str, dict[str, Any]]], model_dir: Path,
                   launches: list[Any], tensors: list, baselines: dict[str, float], work_dir: Path,
                   args: argparse.Namespace, versions: count) -> dict[str, Any]:
    """Start ``launches`` on ``model_dir`` and measure every transport pushing ``tensors`` into them."""
    from miles_weights.launch import running_engines

    device = "cpu" if launches[0].device == "cpu" else "cuda"
    out: dict[str, Any] = {"transports": {}}
    work_dir.mkdir(parents=True, exist_ok=True)
    # the engine service of the command's kernel; the disk transport writes in work_dir
    with running_engines(model_dir, launches, work_dir, kernel=ctx.kernel) as engines:
        urls = engines.urls
        for label, name, overrides in transports:
            if device == "cuda" and name == "broadcast":
                if len(urls) < 2:
                    out["transports"][label] = {"skipped": "NCCL needs the engine on a second GPU (two ranks on one "
                                                           "device are refused); run on a machine with 2 GPUs"}
                    continue
                target, baseline = urls[1], "p2p_copy"
            else:
                target, baseline = urls[0], "memcpy" if device == "cpu" else "device_copy"
            try:
                measured = _measure(ctx, name, overrides, target, tensors, work_dir, args, versions)
            except Exception as exc:  # one transport failing must not hide the others' numbers
                out["transports"][label] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            measured["baseline"] = baseline
            measured["ratio_to_baseline"] = measured["gbps_best"] / baselines[baseline]
            out["transports"][label] = measured
    return out["transports"]


def _measure(ctx: RunContext, name: str, overrides: dict[str, Any], target: str, tensors: list, work_dir: Path,
             args: argparse.Namespace, versions: count) -> dict[str, Any]:
    """One transport: a check-mode push, a warm-up and ``--repeats`` timed pushes. Each transport
    is created as a run creates it, from a config of its own in this command's context."""
    from miles.config import MilesConfig

    spec = ctx.kernel.weight_transports().get(name)
    extra = {"weight_transport": WeightTransportSection(disk_dir=work_dir / "disk", **overrides)}

    def run_with(check: bool) -> RunContext:
        weights = WeightsSection(transport=name, bucket_mb=args.bucket_mb, check=check)
        return ctx.with_config(MilesConfig(weights=weights, extra=extra))

    checker = spec.create(run_with(check=True))
    try:
        checker.push(iter(tensors), targets=[target], version=next(versions))  # raises unless bit-exact
    finally:
        checker.close()
    transport = spec.create(run_with(check=False))
    try:
        transport.push(iter(tensors), targets=[target], version=next(versions))  # warm-up
        reports = [transport.push(iter(tensors), targets=[target], version=next(versions)) for _ in range(args.repeats)]
    finally:
        transport.close()
    rates = [r.gbps for r in reports]
    return {
        "gbps_best": max(rates),
        "gbps_median": statistics.median(rates),
        "seconds_median": statistics.median(r.seconds for r in reports),
        "paused_seconds_median": statistics.median(r.paused_seconds for r in reports),
        "num_buckets": reports[0].num_buckets,
        "check": "bit-exact",
    }
