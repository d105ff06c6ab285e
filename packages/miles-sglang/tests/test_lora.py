"""LoRA on SGLang engines, the pure parts: the launch flags that make room for the run's adapters,
and the engine calls and request fields of adapter syncs across versions. SGLang itself needs
CUDA: ``scripts/h200/sglang_lora.py`` makes these calls against a real server."""

from __future__ import annotations

import pytest
from miles_contracts import EngineSpec
from miles_contracts.lora import LoRASpec
from miles_sglang import SGLangSection, launch_plan
from miles_sglang.lora import EngineCall, adapter_name, adapter_sync_calls, lora_flags, request_fields

SPEC = LoRASpec(rank=32, alpha=64.0, target_modules=["q_proj", "v_proj", "down_proj"])


def test_a_lora_engine_starts_with_room_for_the_runs_adapters() -> None:
    plan = launch_plan(EngineSpec(model_path="/models/m", port=30001), SGLangSection(sglang_args=["--extra"]), lora=SPEC)
    argv = plan.argv
    at = argv.index("--enable-lora")
    assert argv[at:at + 7] == ["--enable-lora", "--max-lora-rank", "32", "--lora-target-modules",
                               "q_proj", "v_proj", "down_proj"]
    assert argv[-1] == "--extra"  # the user's own arguments still come last
    assert "--enable-lora" not in launch_plan(EngineSpec(model_path="/models/m", port=30001), SGLangSection()).argv
    assert lora_flags(LoRASpec(rank=4, target_modules=["o_proj"])) == [
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "o_proj"]


def test_each_sync_loads_its_version_and_retires_the_one_before_the_last() -> None:
    paused, after = adapter_sync_calls(1, "/runs/r/weight_sync/v1")
    assert paused == [EngineCall("/load_lora_adapter", {"lora_name": "miles-v1", "lora_path": "/runs/r/weight_sync/v1"}),
                      EngineCall("/update_weight_version", {"new_version": "1", "abort_all_requests": False})]
    assert after == []
    assert adapter_sync_calls(2, "/f")[1] == []  # v1 may still serve requests admitted before the pause
    paused, after = adapter_sync_calls(5, "/f5")
    assert paused[0].body == {"lora_name": "miles-v5", "lora_path": "/f5"}
    assert after == [EngineCall("/unload_lora_adapter", {"lora_name": "miles-v3"})]


def test_requests_name_the_adapter_of_their_version() -> None:
    assert request_fields(0) == {}  # before the first sync: the base model
    assert request_fields(7) == {"lora_path": "miles-v7"}
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="adapter versions start at 1"):
            adapter_name(bad)  # type: ignore[arg-type]
