"""LoRA adapters on SGLang engines: the launch flags, and the engine calls of one adapter sync.

SGLang serves LoRA adapters by name next to its base model (``--enable-lora``) and loads them
while it runs (``POST /load_lora_adapter {"lora_name", "lora_path"}``, a PEFT folder it reads;
``POST /unload_lora_adapter {"lora_name"}``). A request picks one with ``"lora_path": <name>``;
a request without one is served by the base.

Miles maps weight version ``v`` to the adapter ``miles-v<v>``: a sync writes the trained
adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, what
``miles_engine.lora.write_peft_adapter`` writes), loads it under the new name while generation
is paused, sets the weight version, and unloads the adapter of two versions before. The one
before stays loaded: requests admitted under it may still be running when generation continues
(``pause_mode: in_place``), and a request must finish on the version it started on; so at most
three adapters are loaded at once, within SGLang's default ``--max-loras-per-batch`` (8).

Pure functions of their arguments (no HTTP here): the run's transport and the GPU check
(``scripts/h200/sglang_lora.py``) make the calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_contracts.lora import LoRASpec

ADAPTER_PREFIX = "miles-v"
KEPT_VERSIONS = 2  # the new adapter and the one requests in flight may still use


def lora_flags(spec: LoRASpec) -> list[str]:
    """SGLang flags that make room for adapters of ``spec``'s rank on ``spec``'s target modules
    (both must be known at start: adapters are loaded later, by the first sync)."""
    return ["--enable-lora", "--max-lora-rank", str(spec.rank), "--lora-target-modules", *spec.target_modules]


def adapter_name(version: int) -> str:
    """The SGLang adapter name of Miles weight version ``version``."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"adapter versions start at 1 (version 0 is the base model), got {version!r}")
    return f"{ADAPTER_PREFIX}{version}"


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One HTTP call to an engine: ``POST path`` with the JSON ``body``."""

    path: str
    body: dict[str, Any]


def adapter_sync_calls(version: int, adapter_folder: str) -> tuple[list[EngineCall], list[EngineCall]]:
    """``(while paused, after continuing)``: the calls that make ``version``'s adapter, written at
    ``adapter_folder`` (a path the engine can read), the one new requests use.

    While paused: load it, set the weight version. After generation continued: unload the adapter
    of ``version - 2`` (nothing for the first two versions)."""
    name = adapter_name(version)
    paused = [EngineCall("/load_lora_adapter", {"lora_name": name, "lora_path": adapter_folder}),
              EngineCall("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})]
    retired = version - KEPT_VERSIONS
    after = [EngineCall("/unload_lora_adapter", {"lora_name": adapter_name(retired)})] if retired >= 1 else []
    return paused, after


def request_fields(version: int) -> dict[str, str]:
    """What a generation request to an SGLang engine carries to be served by ``version``'s
    adapter (``{}`` for version 0: the base model, before the first sync)."""
    return {"lora_path": adapter_name(version)} if version >= 1 else {}
