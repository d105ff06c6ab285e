"""``miles bench train``: tokens/s and MFU of the fsdp backend's training step, against plain HF.

Model FLOPs of one sequence of ``L`` tokens (forward + backward, recomputation not counted)::

    6 * P * L  +  6 * n_layers * (n_heads * head_dim) * L^2

``P`` counts the weights of every matrix multiply (all linear layers and the output head; the
embedding lookup is not a multiply). The second term is causal attention: ``Q K^T`` and ``P V``,
``2 * L^2 * d`` FLOPs each over the causal half, times 3 for forward and backward. MFU is achieved
model FLOPs per second over the device peak: 989 TFLOP/s dense bf16 on H100/H200 SXM, or, on CPU,
an fp32 matmul measured in the same run.

The baseline, measured in the same run on the same model and batch: a plain transformers training
loop (fp32 weights, bf16 autocast on CUDA, ``labels=`` loss over full logits, fused AdamW), one
sequence per forward like the fsdp run.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from miles_contracts import LoRASpec, RunContext
    from transformers import PreTrainedModel

Device = Literal["auto", "cpu", "cuda"]  # ModelSection.device, --device

H200_BF16_DENSE_TFLOPS = 989.0

# random-weight model configs (transformers config kwargs); names say which public model they copy
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1_000_000.0,
    ),
    # Qwen3-8B's published config.json (8.19 B parameters, untied head): the largest LoRA shape (issue 32)
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1_000_000.0,
    ),
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500_000.0,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=8192, rope_theta=100_000.0,
    ),
    "tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=4096, rope_theta=10_000.0,
    ),
}


@dataclass(frozen=True, slots=True)
class FlopCounter:
    matmul_params: int
    layers: int
    attention_width: int  # n_heads * head_dim

    @classmethod
    def of(cls, model: PreTrainedModel) -> FlopCounter:
        cfg = model.config
        params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(params, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)

    def sequence(self, length: int) -> float:
        return 6.0 * self.matmul_params * length + 6.0 * self.layers * self.attention_width * length**2


def build_model(preset: str, seed: int = 0, device: torch.device | str = "cpu") -> PreTrainedModel:
    """The preset's random-weight model, initialised directly on ``device`` (seconds on a GPU, a minute on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(PRESETS[preset])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def row_lengths_for(rows: int, length: int, spread: float = 0.0, seed: int = 0) -> list[int]:
    """Each row's real length: ``length``, or with ``spread`` > 0 drawn uniformly from
    ``[(1 - spread) * length, length]`` (deterministic; RL responses are not all one length)."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"length spread must be in [0, 1), got {spread}")
    if spread == 0.0:
        return [length] * rows
    gen = torch.Generator().manual_seed(seed + 1)
    shortest = max(2, int((1.0 - spread) * length))
    return torch.randint(shortest, length + 1, (rows,), generator=gen).tolist()


def make_batch(rows: int, length: int, vocab: int, seed: int = 0, lengths: list[int] | None = None):
    """``rows`` sequences of random tokens, right-padded to ``length`` (each ``lengths[r]`` long,
    default all full), every real position after the first trained."""
    from miles_contracts import TrainBatch

    lengths = lengths or [length] * rows
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, length), generator=gen)
    attention = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    tokens = tokens * attention
    loss_mask = attention.float()
    loss_mask[:, 0] = 0
    advantages = torch.where(torch.rand(rows, 1, generator=gen) > 0.5, 1.0, -1.0) * loss_mask
    return TrainBatch(
        tokens=tokens, attention_mask=attention, loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(rows, length), rewards=torch.zeros(rows), group_ids=torch.zeros(rows, dtype=torch.long),
        rollout_ids=torch.arange(rows), advantages=advantages,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def _profile(step: Callable[[], object], device: torch.device, out: Path) -> dict[str, Any]:
    """One more step under torch.profiler: its op tables go to ``out`` (text); returns the step's
    wall time and how much of it the device spent in kernels (the rest is launch overhead and syncs)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # kernel rows only (an op's own row repeats its kernels' time)
    kernels_s = (sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
                 if device.type == "cuda" else None)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"one step under the profiler: {wall:.3f} s wall, kernels {kernels_s} s\n\n"
                   f"by {sort}:\n{events.table(sort_by=sort, row_limit=40)}\n\n"
                   f"by cpu_time_total:\n{events.table(sort_by='cpu_time_total', row_limit=25)}\n")
    return {"profiled_step_s": wall, "kernel_s": kernels_s, "kernel_share": kernels_s / wall if kernels_s else None,
            "profile": str(out)}


def _time_and_profile(step: Callable[[], object], device: torch.device, warmup: int, steps: int,
                      profile_to: Path | None) -> dict[str, Any]:
    result: dict[str, Any] = {"step_s": _time_steps(step, device, warmup, steps)}
    if profile_to is not None:
        result.update(_profile(step, device, profile_to))
    return result


def _memory_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul throughput of this CPU (the CPU stand-in for a datasheet peak)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def run_miles(preset: str, batch, *, ctx: RunContext, device: Device, options: dict[str, Any], gradient_checkpointing: bool,
              micro_batch_tokens: int, warmup: int, steps: int, profile_to: Path | None = None,
              lora: LoRASpec | None = None, true_on_policy: bool = False) -> dict[str, Any]:
    """The fsdp backend's step on the preset's random model, built in memory (no checkpoint);
    with ``lora``, adapters on the frozen base (``train.lora``); with ``true_on_policy``, the
    batch-invariant forward (its check counts: the benchmark's rollout log-probs are zeros)."""
    from miles.config import MilesConfig
    from miles.sections import ModelSection, RolloutSection, RunSection, TrainSection

    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection

    config = MilesConfig(
        model=ModelSection(device=device),
        run=RunSection(steps=warmup + steps + 1),
        train=TrainSection(lr=1e-6, micro_batch_tokens=micro_batch_tokens, gradient_checkpointing=gradient_checkpointing,
                           lora=lora),
        rollout=RolloutSection(true_on_policy=true_on_policy, true_on_policy_check="metric"),
        extra={"fsdp": FSDPSection(**options)},
    )
    from miles.trainer.device import pick_device

    backend = FSDPBackend(ctx.with_config(config), actor=build_model(preset, device=pick_device(device)))
    dev = backend.dist.device
    try:
        timed = _time_and_profile(lambda: backend.train_step(batch), dev, warmup, steps, profile_to)
        return {**timed, "peak_memory_gb": _memory_gb(dev), "compiled": backend.compiled}
    finally:
        backend.close()
        _free(dev)


def run_registered(backend_name: str, preset: str, batch, *, ctx: RunContext, device: Device, options: dict[str, Any],
                   section: str | None, gradient_checkpointing: bool, micro_batch_tokens: int, warmup: int, steps: int,
                   work_dir: Any, profile_to: Path | None = None, lora: LoRASpec | None = None) -> dict[str, Any]:
    """The step of any train backend registered with ``ctx.kernel`` (e.g. ``megatron``) on the
    preset's random model, saved once as a checkpoint folder the backend loads like any model;
    with ``lora``, adapters on its frozen base (``train.lora``)."""
    import tempfile

    from miles.config import MilesConfig
    from miles.sections import ModelSection, RunSection, TrainSection

    # one folder per rank: under torchrun every rank writes its own copy (no race)
    folder = Path(work_dir or tempfile.mkdtemp(prefix="miles-bench-")) / f"{preset}-rank{os.environ.get('RANK', '0')}"
    if not (folder / "config.json").is_file():
        build_model(preset, device="cpu").save_pretrained(folder, safe_serialization=True)
    extra = {section: ctx.kernel.config_sections().get(section).model(**options)} if section else {}
    config = MilesConfig(
        model=ModelSection(name=str(folder), device=device), run=RunSection(steps=warmup + steps + 1),
        train=TrainSection(backend=backend_name, lr=1e-6, micro_batch_tokens=micro_batch_tokens,
                           gradient_checkpointing=gradient_checkpointing, lora=lora),
        extra=extra,
    )
    backend = ctx.kernel.train_backends().get(backend_name).create(ctx.with_config(config))
    dev = getattr(backend, "device", None) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        timed = _time_and_profile(lambda: backend.train_step(batch), dev, warmup, steps, profile_to)
        return {**timed, "peak_memory_gb": _memory_gb(dev), "backend": backend_name,
                "transformer_engine": getattr(backend, "transformer_engine", None)}
    finally:
        backend.close()
        _free(dev)


def run_baseline(preset: str, batch, *, device: torch.device, gradient_checkpointing: bool, warmup: int, steps: int) -> dict[str, Any]:
    """Plain transformers: fp32 weights, bf16 autocast on CUDA, full-logits loss, AdamW."""
    from miles_fsdp.models import enable_activation_checkpointing

    model = build_model(preset, device=device)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True if cuda else None, foreach=None if cuda else True)

    def step() -> None:
        for row, n in enumerate(batch.attention_mask.sum(1).tolist()):
            ids = batch.tokens[row : row + 1, :n].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss / batch.size
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = _time_steps(step, device, warmup, steps)
    return {"step_s": seconds, "peak_memory_gb": _memory_gb(device)}


def _rates(result: dict[str, Any], tokens: int, flops: float, peak_tflops: float, devices: int = 1) -> dict[str, Any]:
    """Throughput of a step that ``devices`` GPUs (ranks) share: tokens/s of the whole step, TFLOP/s
    and MFU per device (``peak_tflops`` is one device's)."""
    achieved = flops / result["step_s"] / 1e12 / devices
    return {**result, "tokens_per_s": tokens / result["step_s"], "tflops": achieved, "mfu": achieved / peak_tflops}


def _on_policy_pairs(first_default: dict[str, Any], arm: Callable[[bool, bool], dict[str, Any]],
                     repeats: int) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """``repeats`` pairs of the default step and the true on-policy step, each measured in a fresh
    backend after its own warm-up, in alternating order (default first in even pairs) so a machine
    that drifts during the run weighs on both arms. Returns the median-step run of each arm and the
    pairs' step times and ratios."""
    defaults, invariants, pairs = [first_default], [], []
    for r in range(repeats):
        last = r == repeats - 1
        if r == 0:
            invariants.append(arm(True, last))
        elif r % 2:
            invariants.append(arm(True, last))
            defaults.append(arm(False, last))
        else:
            defaults.append(arm(False, last))
            invariants.append(arm(True, last))
        pairs.append({"default_step_s": defaults[-1]["step_s"], "true_on_policy_step_s": invariants[-1]["step_s"],
                      "slowdown": invariants[-1]["step_s"] / defaults[-1]["step_s"]})

    def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(runs, key=lambda run: run["step_s"])[(len(runs) - 1) // 2]

    return median_run(defaults), median_run(invariants), pairs


def run_benchmark(
    *, ctx: RunContext, preset: str, seq_lens: list[int], tokens_per_step: int, warmup: int, steps: int, device: Device,
    gradient_checkpointing: bool, options: dict[str, Any], baseline: bool, peak_tflops: float | None,
    micro_batch_tokens: int | None = None, backend: str = "fsdp", section: str | None = None, work_dir: Any = None,
    profile_dir: Path | None = None, length_spread: float = 0.0, lora: LoRASpec | None = None,
    true_on_policy: bool = False, repeats: int = 1,
) -> dict[str, Any]:
    """Every sequence length: the backend's step and (optionally) the baseline; returns the JSON report.

    :param ctx: the context of the process measuring (``miles bench train``'s): its kernel provides
        the backends; each is built with the benchmark's own config (``ctx.with_config``).
    :param true_on_policy: also measure the fsdp step with ``rollout.true_on_policy``, ``repeats``
        times alternating with the default step (the ratio reported is the pairs' median).
    :param backend: other than ``fsdp``, built through ``ctx.kernel``'s train-backend registry with
        ``options`` as its config ``section`` (e.g. ``megatron`` with ``{"tensor_parallel": 2}``).
    :param lora: also measure the backend's step with these adapters on a frozen base (``miles_lora``),
        and the full / LoRA ratios of step time and peak memory."""
    from miles.trainer.device import pick_device

    dev = pick_device(device)
    probe = build_model(preset, device="meta")
    counter = FlopCounter.of(probe)
    vocab = probe.config.vocab_size
    total_params = sum(p.numel() for p in probe.parameters())
    del probe
    # under torchrun every rank works on the same step (TP/CP/PP split it, data parallelism shares it)
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    if peak_tflops is None:
        peak_tflops = H200_BF16_DENSE_TFLOPS if dev.type == "cuda" else measure_cpu_peak_tflops()
    report: dict[str, Any] = {
        "benchmark": "train",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": "bf16 compute, fp32 master weights" if dev.type == "cuda" else "fp32",
        "torch": torch.__version__,
        "model": {"preset": preset, "parameters": total_params, "matmul_parameters": counter.matmul_params,
                  "layers": counter.layers, "attention_width": counter.attention_width},
        "peak_tflops": peak_tflops,
        "devices": devices,
        "peak_source": "H100/H200 SXM dense bf16 datasheet" if dev.type == "cuda" else "fp32 matmul measured in this run",
        "flops_formula": "6 * matmul_parameters * L + 6 * layers * attention_width * L^2 per sequence of L tokens; "
                         "tflops and mfu per device (the step's FLOPs / devices)",
        "gradient_checkpointing": gradient_checkpointing,
        "micro_batch_tokens": micro_batch_tokens or "seq_len (one row per micro-batch)",
        "length_spread": length_spread,
        "backend": backend,
        f"{section or 'fsdp'}_options": options,
        "goal_mfu": 0.35,
        "results": [],
    }
    for length in seq_lens:
        rows = max(1, tokens_per_step // length)
        lengths = row_lengths_for(rows, length, length_spread)
        batch = make_batch(rows, length, vocab, lengths=lengths)
        flops = sum(counter.sequence(n) for n in lengths)
        tokens = sum(lengths)
        entry: dict[str, Any] = {"seq_len": length, "rows": rows, "tokens_per_step": tokens}
        if length_spread:
            entry["row_lengths"] = lengths
        budget = max(length, micro_batch_tokens or length)
        # under torchrun only rank 0 writes the profile
        profile_to = (profile_dir / f"profile-{backend}-L{length}.txt"
                      if profile_dir is not None and os.environ.get("RANK", "0") == "0" else None)
        if backend == "fsdp":
            miles = run_miles(preset, batch, ctx=ctx, device=device, options=options,
                              gradient_checkpointing=gradient_checkpointing, micro_batch_tokens=budget, warmup=warmup,
                              steps=steps, profile_to=profile_to)
        else:
            miles = run_registered(backend, preset, batch, ctx=ctx, device=device, options=options, section=section,
                                   gradient_checkpointing=gradient_checkpointing, micro_batch_tokens=budget,
                                   warmup=warmup, steps=steps, work_dir=work_dir, profile_to=profile_to)
        if true_on_policy and backend == "fsdp":
            def arm(invariant: bool, last: bool, batch=batch, budget=budget, length=length) -> dict[str, Any]:
                to = (profile_dir / f"profile-fsdp-true-on-policy-L{length}.txt"
                      if invariant and last and profile_dir is not None else None)
                return run_miles(preset, batch, ctx=ctx, device=device, options=options, true_on_policy=invariant,
                                 gradient_checkpointing=gradient_checkpointing, micro_batch_tokens=budget,
                                 warmup=warmup, steps=steps, profile_to=to)

            miles, invariant, pairs = _on_policy_pairs(miles, arm, repeats)
            entry["miles_true_on_policy"] = _rates(invariant, tokens, flops, peak_tflops, devices)
            entry["true_on_policy_repeats"] = pairs
            slowdowns = sorted(pair["slowdown"] for pair in pairs)
            entry["true_on_policy_step_slowdown"] = statistics.median(slowdowns)
            entry["true_on_policy_step_slowdown_spread"] = (slowdowns[-1] - slowdowns[0]) / statistics.median(slowdowns)
        entry["miles"] = _rates(miles, tokens, flops, peak_tflops, devices)
        if lora is not None and backend == "fsdp":
            adapted = run_miles(preset, batch, ctx=ctx, device=device, options=options, lora=lora,
                                gradient_checkpointing=gradient_checkpointing, micro_batch_tokens=budget, warmup=warmup,
                                steps=steps)
        elif lora is not None:
            adapted = run_registered(backend, preset, batch, ctx=ctx, device=device, options=options, section=section,
                                     gradient_checkpointing=gradient_checkpointing, micro_batch_tokens=budget,
                                     warmup=warmup, steps=steps, work_dir=work_dir, lora=lora)
        if lora is not None:
            entry["miles_lora"] = {**adapted, "rank": lora.rank, "target_modules": lora.target_modules}
            entry["lora_step_speedup"] = miles["step_s"] / adapted["step_s"]
            if miles["peak_memory_gb"] and adapted["peak_memory_gb"]:
                entry["lora_peak_memory_ratio"] = miles["peak_memory_gb"] / adapted["peak_memory_gb"]
        if baseline:
            plain = run_baseline(preset, batch, device=dev, gradient_checkpointing=gradient_checkpointing,
                                 warmup=warmup, steps=steps)
            _free(dev)  # the baseline's model and optimizer died with its frame
            # the baseline is one process per GPU with the whole step (no sharing)
            entry["baseline"] = _rates(plain, tokens, flops, peak_tflops)
            entry["speedup_vs_baseline"] = entry["baseline"]["step_s"] / entry["miles"]["step_s"]
        report["results"].append(entry)
    return report
