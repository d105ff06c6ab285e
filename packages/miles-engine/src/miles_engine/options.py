"""Engine options as CLI flags and as the ``engine`` config section: one table, three uses
(``miles serve engine`` flags, ``EngineSpec.options`` -> argv, config validation)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # EngineConfig field
    type: type
    help: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.type is bool:
            parser.add_argument(self.option, dest=self.name, action="store_true", default=None, help=self.help)
        else:
            parser.add_argument(self.option, dest=self.name, type=self.type, default=None, help=self.help)

    def argv(self, value: Any) -> list[str]:
        if self.type is bool:
            return [self.option] if value else []
        return [self.option, str(value)]


ENGINE_FLAGS = (
    Flag("max_running_requests", int, "most requests decoding together (default 64)"),
    Flag("context_length", int, "longest prompt + completion (default: the model's max_position_embeddings)"),
    Flag("max_kv_tokens", int, "KV-cache capacity in tokens (default: from --kv-cache-gb)"),
    Flag("kv_cache_gb", float, "KV-cache memory when --max-kv-tokens is not given (default 2 on CPU, 40%% of free GPU memory)"),
    Flag("prefill_tokens_per_step", int, "prompt tokens prefilled between two decode steps (default 2048)"),
    Flag("prefill_wait_ms", float, "idle engine: gather a burst of arriving requests this long at most before prefilling (default 20; 0 = off)"),
    Flag("prefill_gap_ms", float, "the gathering ends once no request arrived for this long (default 2)"),
    Flag("plain_linear", bool, "CPU: keep transformers' linear layers (no oneDNN weight packing; less memory, slower)"),
    Flag("disable_cuda_graph", bool, "CUDA: run decode steps eagerly instead of as replayed CUDA graphs"),
    Flag("seed", int, "seed of requests without sampling_seed (default 0)"),
    Flag("enable_deterministic_inference", bool, "batch-invariant numerics: a request gives the same tokens and "
         "log-probs in any batch (fp32 CPU with oneDNN only; slower)"),
    Flag("tokenizer_path", str, "tokenizer folder if not the model's"),
    Flag("served_model_name", str, "name reported by /get_model_info"),
)
_BY_NAME = {flag.name: flag for flag in ENGINE_FLAGS}


def options_argv(options: dict[str, Any]) -> list[str]:
    """``EngineSpec.options`` (keys of :class:`EngineSection`) as ``miles serve engine`` flags."""
    unknown = sorted(set(options) - set(_BY_NAME))
    if unknown:
        raise ValueError(f"unknown embedded-engine option(s) {unknown}; known: {', '.join(_BY_NAME)}")
    argv: list[str] = []
    for name, value in options.items():
        if value is not None:
            argv += _BY_NAME[name].argv(value)
    return argv


class EngineSection(BaseModel):
    """Config section ``engine``: options of the embedded engine (``rollout.engine: embedded``).
    The model, device and dtype come from the ``model`` section."""

    model_config = ConfigDict(extra="forbid")

    max_running_requests: int = Field(default=64, ge=1, description="most requests decoding together")
    context_length: int | None = Field(default=None, ge=2, description="default: the model's max_position_embeddings")
    max_kv_tokens: int | None = Field(default=None, ge=2, description="KV-cache capacity in tokens")
    kv_cache_gb: float | None = Field(default=None, gt=0, description="KV-cache memory if max_kv_tokens is unset")
    prefill_tokens_per_step: int = Field(default=2048, ge=1)
    prefill_wait_ms: float = Field(
        default=20.0, ge=0, description="idle engine: gather a burst of arriving requests this long at most before prefilling",
    )
    prefill_gap_ms: float = Field(default=2.0, ge=0, description="the gathering ends once no request arrived for this long")
    plain_linear: bool = False
    disable_cuda_graph: bool = False
    seed: int = 0

    def options(self) -> dict[str, Any]:
        """As ``EngineSpec.options``."""
        return self.model_dump(exclude_none=True)
