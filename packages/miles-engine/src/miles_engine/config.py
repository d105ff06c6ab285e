"""Engine settings: the ``engine`` section's options (:class:`~miles_engine.options.EngineSection`,
the one table) plus what a run decides elsewhere -- the model folder, device, dtype and
deterministic mode.

``Engine(path, **options)`` validates its keyword arguments as an :class:`EngineConfig`
(:func:`engine_config`, which reports every bad option at once); a server process builds one from
the run's config with :func:`engine_config_of`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from miles_contracts.lora import LoRASpec
from pydantic import Field, ValidationError

from miles_engine.options import EngineSection

if TYPE_CHECKING:
    from miles.config import MilesConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(EngineSection):
    """How to run one embedded engine: every option of :class:`EngineSection` and

    :ivar model_path: a Hugging Face folder (config.json, safetensors, tokenizer).
    :ivar device: ``auto`` picks CUDA when present, else CPU; ``cuda:N`` a given GPU.
    :ivar dtype: ``auto`` is bf16 on CUDA and fp32 on CPU (bf16 matmuls are ~20x slower on CPUs
        without native bf16).
    :ivar enable_deterministic_inference: batch-invariant numerics (SGLang's flag of the same
        name; ``run.deterministic`` in a run): a request's tokens and log-probs do not depend on
        which requests share its batch. With a ``sampling_seed`` per request, the same request then
        gives the same bits in any run. Only fp32 CPU engines with oneDNN can do it (every linear on
        the packed oneDNN path, decode attention row by row, new requests prefilled one at a time:
        slower); elsewhere the engine logs that only the seeds apply. See
        ``docs/design/reproducibility.md``.
    :ivar true_on_policy: the batch-invariant forward of :mod:`miles_engine.invariant`, the one the
        fsdp trainer runs with ``rollout.true_on_policy``: every linear row by row, attention per
        query over exactly its own keys, new requests prefilled one at a time. fp32 CPU only (an
        error elsewhere); see ``docs/design/true-on-policy.md``.
    :ivar lora: adapters the engine serves unmerged on its base (``train.lora`` of the run, so
        trainer and engine agree); weight updates then carry adapter tensors only, and check mode
        covers those (:mod:`miles_engine.lora`).
    """

    model_path: str
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="auto (CUDA when present), cpu, cuda or cuda:N")
    dtype: DType = "auto"
    enable_deterministic_inference: bool = False
    true_on_policy: bool = False
    lora: LoRASpec | None = None


def engine_config(model_path: str | Path, **options: Any) -> EngineConfig:
    """The settings of an engine on ``model_path`` with ``options`` (keys of :class:`EngineConfig`);
    raises ``ValueError`` listing every bad option."""
    try:
        return EngineConfig(model_path=str(Path(model_path).expanduser()), **options)
    except ValidationError as exc:
        raise ValueError("invalid engine options: " + "; ".join(_describe(e) for e in exc.errors())) from None


def engine_config_of(config: MilesConfig, model_path: str | Path, *, run_dir: str | Path | None = None) -> EngineConfig:
    """The settings of the engine a run (or ``miles serve engine``) starts: the ``engine`` section,
    ``model.device`` / ``model.dtype``, ``run.deterministic``, ``rollout.true_on_policy``, ``train.lora``; the run's folder (where the disk
    transport writes) is a weight folder too."""
    options = config.section("engine", EngineSection).model_dump()
    if run_dir:
        options["weight_dir"] = [*options["weight_dir"], str(run_dir)]
    return engine_config(model_path, device=config.model.device, dtype=config.model.dtype,
                         enable_deterministic_inference=config.run.deterministic, true_on_policy=config.rollout.true_on_policy,
                         lora=config.train.lora, **options)


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "options"
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "extra_forbidden":
        known = ", ".join(name for name in EngineConfig.model_fields if name != "model_path")
        return f"unknown option {where!r}; known: {known}"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
              "less_than": ("<", "lt")}
    if kind in bounds:
        symbol, key = bounds[kind]
        return f"{where} must be {symbol} {ctx.get(key)}, got {error['input']!r}"
    return f"{where}: {error['msg']} (got {error['input']!r})"
