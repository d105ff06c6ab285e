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

Pure functions of their arguments (no HTTP here): the ``sglang_lora`` weight transport
(``miles_weights.adapters``), the router (``request_fields`` per engine) and the GPU check
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


def load_call(version: int, adapter_folder: str) -> EngineCall:
    """The call, made while generation is paused, that loads ``version``'s adapter (the PEFT folder
    at ``adapter_folder``, a path the engine can read) under :func:`adapter_name`."""
    return EngineCall("/load_lora_adapter", {"lora_name": adapter_name(version), "lora_path": adapter_folder})


def retire_calls(version: int) -> list[EngineCall]:
    """The calls, made after generation continued with ``version``, that unload the adapter of
    ``version - 2`` (nothing for the first two versions)."""
    retired = version - KEPT_VERSIONS
    return [EngineCall("/unload_lora_adapter", {"lora_name": adapter_name(retired)})] if retired >= 1 else []


def adapter_sync_calls(version: int, adapter_folder: str) -> tuple[list[EngineCall], list[EngineCall]]:
    """``(while paused, after continuing)``: every call that makes ``version``'s adapter, written at
    ``adapter_folder``, the one new requests use: load it and set the weight version while paused
    (:func:`load_call`), unload the one of ``version - 2`` after (:func:`retire_calls`)."""
    paused = [load_call(version, adapter_folder),
              EngineCall("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})]
    return paused, retire_calls(version)


def request_fields(version: int) -> dict[str, str]:
    """What a generation request to an SGLang engine carries to be served by ``version``'s
    adapter (``{}`` for version 0: the base model, before the first sync)."""
    return {"lora_path": adapter_name(version)} if version >= 1 else {}


def served_version(fields: dict[str, str]) -> int:
    """The weight version whose adapter a request carrying ``fields`` (:func:`request_fields`) was
    served by: the version it names, 0 (the base) when it names none."""
    name = fields.get("lora_path")
    if name is None:
        return 0
    if not name.startswith(ADAPTER_PREFIX) or not name[len(ADAPTER_PREFIX):].isdigit():
        raise ValueError(f"{name!r} is not a Miles adapter name ({ADAPTER_PREFIX}<version>)")
    return int(name[len(ADAPTER_PREFIX):])
