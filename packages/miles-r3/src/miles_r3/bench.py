"""``miles bench r3``: what routing replay buys and what it costs, as JSON.

MoE presets: a real embedded engine samples rollouts from a random-weight Qwen3-MoE and reports its
routing; the ``fsdp`` backend then scores the same rollouts three ways, interleaved, after a warm-up
of each: ``off`` (no routing in the batch: plain training), ``measure`` (``r3.replay: false``: the
trainer routes itself, agreement is counted) and ``replay``. Reported per variant: the train/rollout
log-prob gap (``miles_algorithms.metrics.mismatch_metrics``), routing agreement (``r3/...``) and
the median and spread of the scoring time; ratios against ``off``.

Dense preset: replay must cost nothing. The same backend scores and trains the same batch with the
r3 plugin loaded and ``r3.enabled`` (its wrapper runs on every forward) and with the plugin disabled,
interleaved; the ratio of medians is the cost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from miles.kernel import Kernel
    from miles_contracts import RunContext

Device = Literal["cpu", "cuda"]  # --device
Dtype = Literal["float32", "bfloat16"]  # --dtype

MOE_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts, top-8, expert width 768, GQA 32/4),
    # 8 of its 48 layers (~5.2 B parameters with the tokenizer's vocabulary), so the engine (bf16)
    # and the trainer (fp32 master weights) share one H200
    "qwen3-30b-a3b-8l": dict(
        hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}
DENSE_PRESETS = {"tiny-dense": "tiny", "qwen3-0.6b-dense": "qwen3-0.6b"}  # -> miles_fsdp.bench presets
PROMPTS = ["Solve step by step: 17 * 23 =", "Write a haiku about the sea.", "List three prime numbers:",
           "Translate to French: good morning", "What is the capital of Japan?", "def fibonacci(n):",
           "Explain gravity to a child.", "The quick brown fox"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-moe",
                        help=f"MoE: tiny-moe, {', '.join(MOE_PRESETS)}; dense: {', '.join(DENSE_PRESETS)}")
    parser.add_argument("--tokenizer", help="folder with the tokenizer for a MoE preset (default: the tiny models')")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--router-noise", type=float, default=0.0,
                        help="MoE: add this x std of Gaussian noise to the trainer's router weights (the engine keeps "
                             "the originals), standing in for a trainer that drifted from the engine")
    parser.add_argument("--work-dir", default="/tmp/miles-bench-r3")
    parser.add_argument("--output", help="write the JSON here too")


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    """``miles bench r3`` in the CLI process of ``ctx``, whose kernel (with this plugin in it)
    claims the model's bridge and wraps the backend's forwards."""
    try:
        import miles_engine  # noqa: F401
        import miles_fsdp  # noqa: F401
        import miles_tito  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"miles bench r3 needs the engine, session and fsdp packages ({exc}): pip install 'miles-r3[bench]'") from None
    dtype: Dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.manual_seed(0)
    require_r3(ctx.kernel)
    result = dense_cost(args, dtype, ctx) if args.preset in DENSE_PRESETS else moe_gap(args, dtype, ctx)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


# ----------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def summary(seconds: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds), "repeats": len(seconds)}


def interleaved(variants: dict[str, Callable[[], Any]], repeats: int, device: str) -> dict[str, list[float]]:
    """Each variant once as warm-up, then ``repeats`` rounds of all of them in turn."""
    for fn in variants.values():
        timed(fn, device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, device)[0])
    return times


# ----------------------------------------------------------------------------- MoE: the gap replay closes


def moe_gap(args: argparse.Namespace, dtype: Dtype, ctx: RunContext) -> dict[str, Any]:
    from miles_algorithms.metrics import mismatch_metrics

    from miles_r3 import plugin as r3
    from miles_r3.config import R3Section

    folder = model_folder(args)
    samples, engine_s = rollouts(folder, args, dtype, ctx)
    gc.collect()  # the engine's weights and KV cache: the trainer needs the room
    if args.device == "cuda":
        torch.cuda.empty_cache()
    from miles_contracts import TrainBatch

    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    plain = replace(batch, extras={})
    backend = fsdp_backend(ctx, folder, args.device, dtype, actor=trainer_model(folder, args.router_noise, ctx.kernel))
    results: dict[str, Any] = {}

    def score(replay: bool | None) -> Callable[[], Any]:
        def go() -> Any:
            r3.STATE.settings = R3Section(enabled=True, replay=bool(replay))
            return backend.compute_logprobs(plain if replay is None else batch)
        return go

    variants = {"off": score(None), "measure": score(False), "replay": score(True)}
    times = interleaved(variants, args.repeats, args.device)
    r3.STATE.stats.flush()
    for name, fn in variants.items():
        logprobs = fn()
        stats = {k.rsplit("/", 1)[1]: v for k, v in r3.STATE.stats.flush().items()}
        results[name] = {**mismatch_metrics(logprobs, batch), **stats, **summary(times[name])}
    base = results["off"]["median_s"]
    for name in ("measure", "replay"):
        results[name]["time_ratio_vs_off"] = results[name]["median_s"] / base
    backend.close()
    return {
        "preset": args.preset, "device": device_name(args.device), "dtype": dtype, "rollouts": len(samples),
        "router_noise": args.router_noise,
        "response_tokens": int(batch.loss_mask.sum()), "recorded_tokens": sum(len(s.tokens) - 1 for s in samples),
        "engine_rollout_s": engine_s, "variants": results,
    }


def model_folder(args: argparse.Namespace) -> Path:
    """The tiny MoE, or a random-weight preset saved once under ``--work-dir`` with a tokenizer."""
    from miles_models.testing import tiny_model

    if args.preset == "tiny-moe":
        return tiny_model("moe")
    if args.preset not in MOE_PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; choose tiny-moe, {', '.join([*MOE_PRESETS, *DENSE_PRESETS])}")
    folder = Path(args.work_dir) / args.preset
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else tiny_model("moe")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3MoeConfig(**MOE_PRESETS[args.preset], vocab_size=len(tokenizer),
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.device(args.device):
        # transformers wraps PreTrainedModel.to with functools.wraps: typeshed's _Wrapped binds no self
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    del model
    return folder


def trainer_model(folder: Path, router_noise: float, kernel: Kernel) -> Any:
    """The trainer's copy of the model (fp32 master weights), its routers perturbed if asked (their
    place is what the bridge ``kernel`` finds for the model says)."""
    from transformers import AutoModelForCausalLM

    from miles_r3.layer_map import layer_map_of

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if router_noise:
        hf_config = json.loads((folder / "config.json").read_text())
        layer_map = layer_map_of(kernel.find_model_bridge(hf_config), hf_config)
        if layer_map is None:
            raise SystemExit(f"--router-noise: {folder} is a dense model, it has no routers")
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in layer_map.moe_layers:
                weight = model.get_parameter(f"{layer_map.router_path(layer)}.weight")
                weight.add_(torch.randn(weight.shape, generator=generator) * router_noise * weight.std())
    return model


def rollouts(folder: Path, args: argparse.Namespace, dtype: Dtype, ctx: RunContext) -> tuple[list[Any], float]:
    """``args.rollouts`` sampled answers (temperature 1) with their routing, from a real engine
    (the generator runs in this process, as in a run's driver, with ``ctx`` as its run)."""
    from miles.builtin.generators import single_turn
    from miles.engine_client import HttpEngineClient
    from miles_contracts import GenerateContext, Sample
    from miles_contracts.wire.engine import SamplingParams
    from miles_engine import Engine, create_app
    from miles_tito.server.background import BackgroundServer
    from transformers import AutoTokenizer

    from miles_r3.capture import RoutedExpertsCapture
    from miles_r3.experts import ROUTED_EXPERTS
    from miles_r3.layer_map import layer_map_of

    hf_config = json.loads((folder / "config.json").read_text())
    layer_map = layer_map_of(ctx.kernel.find_model_bridge(hf_config), hf_config)
    if layer_map is None:
        raise SystemExit(f"{folder} is a dense model: there is no routing to record")
    engine = Engine(folder, device=args.device, dtype=dtype, max_running_requests=args.rollouts, kv_cache_gb=4.0)
    try:
        with BackgroundServer(lambda: create_app(engine)) as server:
            async def generate() -> list[Sample]:
                client = HttpEngineClient(server.url)
                params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
                generate_ctx = GenerateContext(engine=client, tokenizer=AutoTokenizer.from_pretrained(folder),
                                               sampling_params=params, max_context_len=4096, run=ctx,
                                               captures=[RoutedExpertsCapture(layer_map)])
                try:
                    prompts = [Sample(prompt=PROMPTS[i % len(PROMPTS)], index=i) for i in range(args.rollouts)]
                    return list(await asyncio.gather(*(single_turn(s, generate_ctx) for s in prompts)))
                finally:
                    await client.aclose()

            seconds, samples = timed(lambda: asyncio.run(generate()), args.device)
    finally:
        engine.shutdown()
    bad = [s.exit_detail for s in samples if ROUTED_EXPERTS not in s.stash]
    if bad:
        raise SystemExit(f"{len(bad)} rollouts came back without routing: {bad[:3]}")
    for s in samples:
        s.reward = 1.0
    return samples, seconds


def fsdp_backend(ctx: RunContext, folder: Path | None, device: Device, dtype: Dtype, actor: Any = None, **train: Any) -> Any:
    """An fsdp backend on ``actor`` in this process, with ``ctx``'s kernel and a config of its own."""
    from miles.config import MilesConfig
    from miles.sections import ModelSection, RolloutSection, RunSection, TrainSection
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection

    config = MilesConfig(
        model=ModelSection(name=str(folder or "in-memory"), device=device, dtype=dtype), run=RunSection(steps=100),
        rollout=RolloutSection(temperature=1.0), train=TrainSection(micro_batch_tokens=16384, **train),
        extra={"fsdp": FSDPSection(compile=False)},  # replay hooks are kept out of compiled graphs
    )
    return FSDPBackend(ctx.with_config(config), actor=actor)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# ----------------------------------------------------------------------------- dense: the cost of nothing

def dense_cost(args: argparse.Namespace, dtype: Dtype, ctx: RunContext) -> dict[str, Any]:
    """One actor, one batch; per round the step runs once with the r3 plugin loaded and enabled and
    once with it disabled (only ``backend.runner.kernel`` differs)."""
    from miles_fsdp.bench import build_model, make_batch

    from miles_r3 import plugin as r3
    from miles_r3.config import R3Section

    model = build_model(DENSE_PRESETS[args.preset], device=args.device)
    rows, length = (8, 64) if args.preset == "tiny-dense" else (32, 512)
    batch = make_batch(rows, length, model.config.vocab_size)
    batch = replace(batch, old_logprobs=torch.zeros_like(batch.loss_mask))
    with_r3, without_r3 = ctx.kernel, kernel_without_r3(ctx.kernel)
    r3.STATE.settings = R3Section(enabled=True)
    backend = fsdp_backend(ctx, None, args.device, dtype, actor=model, lr=1e-9)

    def step(kernel: Any) -> Callable[[], Any]:
        def go() -> Any:
            backend.runner.kernel = kernel  # same model, same batch: only the plugin set differs
            backend.compute_logprobs(batch)
            return backend.train_step(batch)
        return go

    times = interleaved({"r3_enabled": step(with_r3), "r3_disabled": step(without_r3)}, args.repeats, args.device)
    wrapper = {name: wrapper_cost(kernel, backend.actor.hf, batch) for name, kernel in
               (("r3_enabled", with_r3), ("r3_disabled", without_r3))}
    backend.close()
    enabled, disabled = summary(times["r3_enabled"]), summary(times["r3_disabled"])
    return {
        "preset": args.preset, "device": device_name(args.device), "dtype": dtype, "rows": rows, "tokens": rows * length,
        "measured": "compute_logprobs + train_step (lr 1e-9) of one batch",
        "r3_enabled": enabled, "r3_disabled": disabled,
        "time_ratio_enabled_vs_disabled": enabled["median_s"] / disabled["median_s"],
        "time_ratio_enabled_vs_disabled_min": enabled["min_s"] / disabled["min_s"],
        "run_forward_us_per_call": wrapper,
    }


def has_r3(kernel: Kernel) -> bool:
    return any(info.name == "r3" and info.status == "loaded" for info in kernel.plugins())


def require_r3(kernel: Kernel) -> None:
    """Refuse a kernel without this plugin: what the bench measures is its wrapper."""
    if not has_r3(kernel):
        raise SystemExit("miles bench r3 needs the r3 plugin loaded (it is disabled by plugins.disable or "
                         "MILES_DISABLE_PLUGINS)")


def kernel_without_r3(kernel: Kernel) -> Kernel:
    """The same plugin selection as ``kernel``'s with r3 disabled.

    This is the one place the bench builds a kernel of its own: the dense preset compares a step
    with the r3 plugin loaded against the same step without it, and the context it runs in holds
    only the first. Built directly rather than through ``Kernel.load``, so the process's cached
    kernels are left alone.
    """
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection, load_plugins

    selection = PluginSelection.from_settings(kernel.selection.enable, (*kernel.selection.disable, "r3"))
    return Kernel(load_plugins(selection), selection)


def standalone_context() -> RunContext:
    """The context of ``python -m miles_r3.bench``, a process of its own: the default plugins, on a
    kernel built here, with the r3 plugin registered in process where its entry point is not
    installed (a device whose workspace wheels predate miles-r3)."""
    from miles.context import context_for
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection, load_plugins

    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    if not any(info.name == "r3" for info in kernel.plugins()):  # not installed (a plugin blocked is listed)
        from miles_r3 import plugin

        kernel.register_plugin(plugin, name="r3")
    return context_for(kernel=kernel)


def wrapper_cost(kernel: Any, model: Any, batch: Any, calls: int = 20000) -> float:
    """Microseconds one ``Kernel.run_forward`` call costs around an empty forward (best of 5)."""
    from miles_contracts import ForwardContext

    ctx = ForwardContext(phase="train", model=model, batch=batch, backend="fsdp", state={"dummy": False})
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            kernel.run_forward(ctx, lambda: None)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> int:  # python -m miles_r3.bench
    parser = argparse.ArgumentParser(prog="miles bench r3", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(), standalone_context())


if __name__ == "__main__":
    raise SystemExit(main())

