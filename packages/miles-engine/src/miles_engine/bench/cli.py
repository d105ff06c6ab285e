"""``miles bench engine``: generated tokens/s of the embedded engine against ``transformers``
``generate`` (and vLLM-CPU with ``--vllm-python``, SGLang on CUDA with ``--systems ... sglang``),
same model, prompts and sampling, at several concurrencies; prints JSON with medians and ratios.
On CUDA it also reports how close each decode step comes to the memory-bandwidth roofline (bytes
of weights + KV read per step / step time).

Every system runs one untimed warm-up at each concurrency before its timed runs there: the first
run at a new batch size pays one-time costs (CUDA graphs captured for new batch buckets, cuBLAS
and oneDNN kernels chosen or JIT-compiled per shape, the allocator growing), 27-50% of a run on
the H200. At least 3 timed runs per configuration: the median of two is their mean. Each
configuration reports the median, every run, and the spread ((max - min) / median).

    miles bench engine --model smollm2-135m-instruct --concurrency 1 8 32 --repeats 3 \\
        --vllm-python /work/venvs/vllm/bin/python --out docs/benchmarks/engine-cpu.json
    miles bench engine --model .benchcfg --random-weights --systems embedded sglang \\
        --sglang-python python3 --sglang-env PYTHONPATH=/tmp/sg --concurrency 1 32 128 256
    miles bench engine --sessions --turns 50 --user-tokens 80 --answer-tokens 80   # prefix cache on vs off
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from miles.cli import emit_json

from miles_engine.bench import sessions
from miles_engine.bench.systems import EmbeddedSystem, GenerateSystem, Measured, SGLangSystem, VLLMSystem
from miles_engine.bench.workload import Workload, build_workload

H200_BANDWIDTH_TBS = 4.8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=_at_least_three, default=3,
                        help="timed runs per configuration after its warm-up (median reported; at least 3)")
    parser.add_argument("--systems", nargs="+", default=["embedded", "generate", "vllm"],
                        choices=["embedded", "embedded_eager", "embedded_deterministic", "embedded_true_on_policy", "generate",
                                 "vllm", "sglang"],
                        help="embedded_eager: the embedded engine without CUDA graphs; embedded_deterministic: with "
                             "--enable-deterministic-inference and a sampling_seed per request (run.deterministic); "
                             "embedded_true_on_policy: the batch-invariant forward (rollout.true_on_policy); "
                             "sglang: SGLang (CUDA), in its own environment")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed; vLLM is skipped without it")
    parser.add_argument("--sglang-python", default=sys.executable, help="python of SGLang's environment")
    parser.add_argument("--sglang-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment of the SGLang process (it never inherits Miles' PYTHONPATH)")
    parser.add_argument("--sglang-attention-backend", default="fa3", help="fa3, flashinfer, triton")
    parser.add_argument("--plain-linear", action="store_true",
                        help="run the embedded engine without oneDNN weight packing on CPU (to measure its effect)")
    parser.add_argument("--peak-bandwidth-tbs", type=float, default=None,
                        help=f"memory bandwidth for the roofline (default {H200_BANDWIDTH_TBS} on CUDA, none on CPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="use random weights built from the model folder's config.json and tokenizer (no weight "
                             "files needed; the same speed): for machines that cannot pull the model")
    parser.add_argument("--out", help="also write the JSON here")
    sessions.add_arguments(parser)


def _at_least_three(text: str) -> int:
    value = int(text)
    if value < 3:
        raise argparse.ArgumentTypeError(f"{value} is too few: give at least 3 (the median of two runs is their mean)")
    return value


def run(args: argparse.Namespace) -> int:
    import torch
    from miles_models import resolve_model
    from transformers import AutoTokenizer

    from miles_engine.loading import resolve_device, resolve_dtype

    model_path = str(resolve_model(args.model, auto_pull=not args.random_weights))
    device = resolve_device(args.device)
    if args.random_weights:
        model_path = _random_copy(model_path, resolve_dtype(args.dtype, device))
    dtype = resolve_dtype(args.dtype, device)
    if args.sessions:
        emit_json({"benchmark": "engine-sessions", "model": args.model, "random_weights": args.random_weights,
                  "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                  "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                  **sessions.run_sessions(args, model_path, len(AutoTokenizer.from_pretrained(model_path)),
                                          _sglang(args, model_path, dtype, device) if "sglang" in args.systems else None)},
                  args.out)
        return 0
    workload = build_workload(AutoTokenizer.from_pretrained(model_path), args.max_new_tokens)
    report: dict[str, Any] = {
        "benchmark": "engine", "model": args.model, "model_path": model_path, "random_weights": args.random_weights,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency, "repeats": args.repeats, "plain_linear": args.plain_linear,
        "mean_prompt_tokens": statistics.mean(len(p) for p in workload.prompts),
        "sampling": {"temperature": workload.temperature, "top_p": 1.0, "top_k": -1, "ignore_eos": True},
        "systems": {},
    }
    runs: dict[str, dict[int, Measured]] = {}
    if "embedded" in args.systems:
        system = EmbeddedSystem(model_path, device=args.device, dtype=args.dtype,
                                max_running_requests=max(args.concurrency), plain_linear=args.plain_linear)
        runs["embedded"] = _measure(system, workload, args.concurrency, args.repeats)
        report["roofline"] = _roofline(system, runs["embedded"], workload, args, device)
        report["cuda_graphs"] = system.engine.server_info()["cuda_graphs"]
        system.close()
    if "embedded_eager" in args.systems:
        system = EmbeddedSystem(model_path, device=args.device, dtype=args.dtype, eager=True,
                                max_running_requests=max(args.concurrency), plain_linear=args.plain_linear)
        runs["embedded_eager"] = _measure(system, workload, args.concurrency, args.repeats)
        report["roofline_eager"] = _roofline(system, runs["embedded_eager"], workload, args, device)
        system.close()
    if "embedded_deterministic" in args.systems:
        system = EmbeddedSystem(model_path, device=args.device, dtype=args.dtype, deterministic=True,
                                max_running_requests=max(args.concurrency), plain_linear=args.plain_linear)
        runs["embedded_deterministic"] = _measure(system, workload, args.concurrency, args.repeats)
        system.close()
    if "embedded_true_on_policy" in args.systems:
        system = EmbeddedSystem(model_path, device=args.device, dtype=args.dtype, true_on_policy=True,
                                max_running_requests=max(args.concurrency), plain_linear=args.plain_linear)
        runs["embedded_true_on_policy"] = _measure(system, workload, args.concurrency, args.repeats)
        system.close()
    if "generate" in args.systems:
        generate = GenerateSystem(model_path, device=args.device, dtype=args.dtype)
        runs["generate"] = _measure(generate, workload, args.concurrency, args.repeats)
        generate.close()
    if "vllm" in args.systems:
        if not args.vllm_python or not Path(args.vllm_python).exists():
            report["systems"]["vllm"] = {"skipped": "no --vllm-python given (a venv with vllm-cpu installed)"}
        elif device.type != "cpu":
            report["systems"]["vllm"] = {"skipped": "vLLM is only compared on CPU (vllm-cpu)"}
        else:
            runs["vllm"] = VLLMSystem(args.vllm_python, model_path).run_all(workload, args.concurrency, args.repeats)
    if "sglang" in args.systems:
        if device.type != "cuda":
            report["systems"]["sglang"] = {"skipped": "SGLang runs on CUDA only"}
        else:
            sglang = _sglang(args, model_path, dtype, device)
            assert sglang is not None  # on CUDA
            runs["sglang"] = sglang.run_all(workload, args.concurrency, args.repeats)
            report["sglang"] = sglang.info
    for name, by_concurrency in runs.items():
        report["systems"][name] = {str(c): _summary(measured) for c, measured in by_concurrency.items()}
    report["ratios"] = _ratios(report["systems"], args.concurrency)
    emit_json(report, args.out)
    return 0


def _measure(system: Any, workload: Workload, concurrencies: list[int], repeats: int) -> dict[int, Measured]:
    out: dict[int, Measured] = {}
    for c in concurrencies:
        warmup = system.run(workload.batch(c), workload)  # untimed: first run at this batch size (see above)
        print(f"  {system.name:9} c={c:<3} {warmup.tokens_per_second:8.1f} tok/s (warm-up)", file=sys.stderr, flush=True)
        out[c] = Measured(warmup, [])
        for _ in range(repeats):
            result = system.run(workload.batch(c), workload)
            out[c].runs.append(result)
            print(f"  {system.name:9} c={c:<3} {result.tokens_per_second:8.1f} tok/s", file=sys.stderr, flush=True)
    return out


def _summary(measured: Measured) -> dict[str, Any]:
    rates = [r.tokens_per_second for r in measured.runs]
    median = statistics.median(rates)
    summary: dict[str, Any] = {"tokens_per_s_median": round(median, 2),
                               "tokens_per_s_runs": [round(r, 2) for r in rates],
                               "spread_pct": round(100 * (max(rates) - min(rates)) / median, 1),
                               "warmup_tokens_per_s": round(measured.warmup.tokens_per_second, 2)}
    if measured.runs[0].extra:
        summary["decode_steps"] = measured.runs[0].extra["decode_steps"]
        summary["mean_decode_batch"] = round(measured.runs[0].extra["mean_decode_batch"], 2)
    return summary


def _ratios(systems: dict[str, Any], concurrencies: list[int]) -> dict[str, dict[str, float]]:
    ratios: dict[str, dict[str, float]] = {}
    for base in ("embedded_eager", "embedded_deterministic", "embedded_true_on_policy", "generate", "vllm", "sglang"):
        if "embedded" not in systems or "tokens_per_s_median" not in str(systems.get(base, {})):
            continue
        ratios[f"embedded/{base}"] = {
            str(c): round(systems["embedded"][str(c)]["tokens_per_s_median"] / systems[base][str(c)]["tokens_per_s_median"], 3)
            for c in concurrencies
        }
    return ratios


def _roofline(system: EmbeddedSystem, runs: dict[int, Measured], workload: Workload,
              args: argparse.Namespace, device) -> dict[str, Any]:
    """Bytes a decode step must read (all weights once + the batch's KV) over its measured time."""
    loaded = system.engine.loaded
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_per_token = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * loaded.dtype.itemsize
    peak = args.peak_bandwidth_tbs or (H200_BANDWIDTH_TBS if device.type == "cuda" else None)
    mean_context = statistics.mean(len(p) for p in workload.prompts) + workload.max_new_tokens / 2
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
                           "peak_bandwidth_tbs": peak, "by_concurrency": {}}
    for c, measured in runs.items():
        step_seconds = statistics.median(r.extra["decode_seconds"] / max(r.extra["decode_steps"], 1)
                                         for r in measured.runs)
        step_bytes = weight_bytes + c * mean_context * kv_per_token
        achieved = step_bytes / step_seconds
        entry = {"decode_step_ms": round(step_seconds * 1000, 3), "bytes_per_step": int(step_bytes),
                 "achieved_tbs": round(achieved / 1e12, 4)}
        if peak:
            entry["fraction_of_roofline"] = round(achieved / (peak * 1e12), 4)
        out["by_concurrency"][str(c)] = entry
    return out


def _sglang(args: argparse.Namespace, model_path: str, dtype: Any, device: Any) -> SGLangSystem | None:
    if device.type != "cuda":
        return None
    return SGLangSystem(args.sglang_python, model_path, dtype=str(dtype).removeprefix("torch."),
                        env=_pairs(args.sglang_env), attention_backend=args.sglang_attention_backend)


def _pairs(items: list[str]) -> dict[str, str]:
    bad = [item for item in items if "=" not in item]
    if bad:
        raise SystemExit(f"--sglang-env takes KEY=VALUE pairs; got {bad}")
    return dict(item.split("=", 1) for item in items)


def _random_copy(model_path: str, dtype) -> str:
    """A folder with the model's config and tokenizer and random weights (seed 0), built once per
    config (the folder name carries a hash of config.json: two configs in folders of one name must
    not share weights)."""
    import hashlib
    import shutil
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"miles-bench-random-{Path(model_path).name}-{digest}-{str(dtype).removeprefix('torch.')}"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".partial-"))
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(out)
