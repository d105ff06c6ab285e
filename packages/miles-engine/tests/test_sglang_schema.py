"""Every field Miles sends to an engine or reads back exists in SGLang's own definitions, with a
compatible JSON type, so a real SGLang server can stand behind the router in place of the
embedded engine.

SGLang cannot run here (CUDA-only wheels, see docs/design/engine-scheduler.md), so its
definitions are recorded below as data, read from the SGLang sources:

* ``python/sglang/srt/managers/io_struct.py`` at commit 001067fffe33427bee0ed2f007fb7551a1d76b44
  (``GenerateReqInput``, ``AbortReq``, ``PauseGenerationReqInput``, ``UpdateWeightFromDiskReqInput``,
  ``UpdateWeightsFromTensorReqInput``, ``InitWeightsUpdateGroupReqInput``,
  ``UpdateWeightsFromDistributedReqInput``, ``UpdateWeightVersionReqInput``);
* ``python/sglang/srt/sampling/sampling_params.py`` at commit 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03
  (``SamplingParams``);
* ``python/sglang/srt/managers/tokenizer_manager.py`` (the ``meta_info`` dict built per output,
  ``get_model_info``) and ``schedule_batch.py`` (``FINISH_*.to_json``), same period.

JSON kinds: ``str int float bool null list[int] list[str] list[list[int]] list dict``; an SGLang
``float`` also accepts our ``int``. A field we do not send is free to be missing here; a field we
send or read must be in the SGLang list.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from miles_contracts.wire import engine as wire
from pydantic import BaseModel

# -- SGLang request definitions (field -> JSON kinds), only the HTTP-visible fields ------------------

SGLANG_GENERATE_REQ = {
    "rid": {"str", "list[str]", "null"}, "session_id": {"str", "null"}, "text": {"str", "list[str]", "null"},
    "input_ids": {"list[int]", "list[list[int]]", "null"}, "input_embeds": {"list", "null"},
    "image_data": {"str", "list", "dict", "null"}, "video_data": {"str", "list", "dict", "null"},
    "audio_data": {"str", "list", "dict", "null"}, "sampling_params": {"dict", "list", "null"},
    "return_logprob": {"bool", "list", "null"}, "logprob_start_len": {"int", "list", "null"},
    "top_logprobs_num": {"int", "list", "null"}, "token_ids_logprob": {"list[int]", "list[list[int]]", "null"},
    "return_text_in_logprobs": {"bool"}, "stream": {"bool"}, "log_metrics": {"bool"},
    "return_hidden_states": {"bool", "list", "str"}, "return_routed_experts": {"bool"},
    "routed_experts_start_len": {"int"}, "modalities": {"list[str]", "null"}, "session_params": {"dict", "null"},
    "lora_path": {"str", "list", "null"}, "custom_logit_processor": {"str", "list", "null"},
    "routed_dp_rank": {"int", "null"}, "routing_key": {"str", "null"}, "priority": {"int", "null"},
    "extra_key": {"str", "list[str]", "null"}, "return_entropy": {"bool"}, "return_prompt_token_ids": {"bool"},
    "cache_salt": {"str", "list[str]", "null"},
}
SGLANG_SAMPLING_PARAMS = {
    "max_new_tokens": {"int", "null"}, "stop": {"str", "list[str]", "null"}, "stop_token_ids": {"list[int]", "null"},
    "stop_regex": {"str", "list[str]", "null"}, "temperature": {"float"}, "top_p": {"float"}, "top_k": {"int"},
    "min_p": {"float"}, "frequency_penalty": {"float"}, "presence_penalty": {"float"},
    "repetition_penalty": {"float"}, "min_new_tokens": {"int"}, "n": {"int"}, "json_schema": {"str", "null"},
    "regex": {"str", "null"}, "ebnf": {"str", "null"}, "structural_tag": {"str", "null"}, "ignore_eos": {"bool"},
    "skip_special_tokens": {"bool"}, "spaces_between_special_tokens": {"bool"}, "no_stop_trim": {"bool"},
    "custom_params": {"dict", "null"}, "stream_interval": {"int", "null"}, "logit_bias": {"dict", "null"},
    "sampling_seed": {"int", "null"},
}
SGLANG_ABORT_REQ = {"rid": {"str", "null"}, "abort_all": {"bool"}, "abort_message": {"str", "null"}}
SGLANG_PAUSE_REQ = {"mode": {"str"}}  # Literal["abort", "retract", "in_place"]
SGLANG_PAUSE_MODES = {"abort", "retract", "in_place"}
SGLANG_UPDATE_FROM_DISK_REQ = {
    "model_path": {"str"}, "load_format": {"str", "null"}, "abort_all_requests": {"bool"},
    "weight_version": {"str", "null"}, "is_async": {"bool"}, "torch_empty_cache": {"bool"}, "keep_pause": {"bool"},
    "recapture_cuda_graph": {"bool"}, "token_step": {"int"}, "flush_cache": {"bool"}, "manifest": {"dict", "null"},
}
SGLANG_UPDATE_FROM_TENSOR_REQ = {
    "serialized_named_tensors": {"list[str]"},  # base64 strings over HTTP (Base64Bytes)
    "load_format": {"str", "null"}, "flush_cache": {"bool"}, "abort_all_requests": {"bool"},
    "weight_version": {"str", "null"}, "disable_draft_model": {"bool", "null"}, "torch_empty_cache": {"bool"},
}
SGLANG_INIT_GROUP_REQ = {
    "master_address": {"str"}, "master_port": {"int"}, "rank_offset": {"int"}, "world_size": {"int"},
    "group_name": {"str"}, "backend": {"str"},
}
SGLANG_UPDATE_FROM_DISTRIBUTED_REQ = {
    "names": {"list[str]"}, "dtypes": {"list[str]"}, "shapes": {"list[list[int]]"}, "group_name": {"str"},
    "flush_cache": {"bool"}, "abort_all_requests": {"bool"}, "weight_version": {"str", "null"},
    "load_format": {"str", "null"}, "torch_empty_cache": {"bool"},
}
# SGLang's default for abort_all_requests here is True; Miles always pauses first, so ours is False.
SGLANG_UPDATE_VERSION_REQ = {"new_version": {"str"}, "abort_all_requests": {"bool"}}

# -- SGLang response fields ----------------------------------------------------------------------------

SGLANG_GENERATE_RESP = {"text": {"str"}, "output_ids": {"list[int]"}, "meta_info": {"dict"}}
SGLANG_META_INFO = {
    "id": {"str"}, "finish_reason": {"dict", "null"}, "prompt_tokens": {"int"}, "completion_tokens": {"int"},
    "cached_tokens": {"int"}, "weight_version": {"str", "null"}, "e2e_latency": {"float", "null"},
    "output_token_logprobs": {"list[list[any]]", "null"},  # [[logprob, token_id, text or null], ...]
    "input_token_logprobs": {"list[list[any]]", "null"},
    "routed_experts": {"str", "null"}, "num_retractions": {"int"}, "reasoning_tokens": {"int"},
}
SGLANG_FINISH_REASON = {  # FINISH_MATCHED_TOKEN / _STR, FINISH_LENGTH, FINISH_ABORT .to_json()
    "type": {"str"}, "matched": {"int", "str", "list[int]", "null"}, "length": {"int", "null"},
    "message": {"str", "null"}, "status_code": {"int", "null"}, "err_type": {"int", "str", "null"},
}
SGLANG_FINISH_TYPES = {"stop", "length", "abort"}
SGLANG_MODEL_INFO = {
    "model_path": {"str"}, "tokenizer_path": {"str", "null"}, "is_generation": {"bool"},
    "weight_version": {"str", "null"}, "model_type": {"str", "null"}, "architectures": {"list[str]", "null"},
}

REQUESTS = [  # what we send: SGLang must accept every kind we may produce
    (wire.GenerateRequest, SGLANG_GENERATE_REQ),
    (wire.SamplingParams, SGLANG_SAMPLING_PARAMS),
    (wire.AbortRequest, SGLANG_ABORT_REQ),
    (wire.PauseGenerationRequest, SGLANG_PAUSE_REQ),
    (wire.UpdateWeightsFromDiskRequest, SGLANG_UPDATE_FROM_DISK_REQ),
    (wire.UpdateWeightsFromTensorRequest, SGLANG_UPDATE_FROM_TENSOR_REQ),
    (wire.InitWeightsUpdateGroupRequest, SGLANG_INIT_GROUP_REQ),
    (wire.UpdateWeightsFromDistributedRequest, SGLANG_UPDATE_FROM_DISTRIBUTED_REQ),
    (wire.UpdateWeightVersionRequest, SGLANG_UPDATE_VERSION_REQ),
]
RESPONSES = [  # what we read: we must accept every kind SGLang may produce
    (wire.GenerateResponse, SGLANG_GENERATE_RESP),
    (wire.MetaInfo, SGLANG_META_INFO),
    (wire.FinishReason, SGLANG_FINISH_REASON),
    (wire.ModelInfo, SGLANG_MODEL_INFO),
]


def json_kinds(annotation: Any) -> set[str]:
    """The JSON kinds a pydantic field annotation can produce or accept."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return set().union(*(json_kinds(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {type(v).__name__ for v in typing.get_args(annotation)}
    if origin is list:
        (item,) = typing.get_args(annotation)
        inner = json_kinds(item)
        return {f"list[{k}]" for k in inner} if len(inner) == 1 else {"list"}
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {"dict"}
    if annotation is type(None):
        return {"null"}
    if annotation is Any:
        return {"any"}
    return {annotation.__name__}


def compatible(kind: str, accepted: set[str]) -> bool:
    """Whether a value of JSON ``kind`` validates against a field accepting ``accepted``."""
    if kind in accepted or "any" in accepted:
        return True
    if kind == "int" and "float" in accepted:
        return True
    return kind.startswith("list") and "list" in accepted


def test_every_field_we_use_exists_in_sglang_with_a_compatible_type():
    problems = []
    for model, sglang in REQUESTS + RESPONSES:
        problems += [f"{model.__name__}.{name}: not an SGLang field" for name in model.model_fields if name not in sglang]
    for model, sglang in REQUESTS:
        hints = typing.get_type_hints(model)
        for name in set(model.model_fields) & set(sglang):
            for kind in json_kinds(hints[name]):
                if not compatible(kind, sglang[name]):
                    problems.append(f"{model.__name__}.{name}: we may send {kind}, SGLang takes {sorted(sglang[name])}")
    for model, sglang in RESPONSES:
        hints = typing.get_type_hints(model)
        for name in set(model.model_fields) & set(sglang):
            ours = json_kinds(hints[name])
            for kind in sglang[name]:
                if not compatible(kind, ours):
                    problems.append(f"{model.__name__}.{name}: SGLang may return {kind}, we read {sorted(ours)}")
    assert not problems, "\n".join(problems)


def test_enumerated_values_are_sglangs():
    pause_modes = set(typing.get_args(typing.get_type_hints(wire.PauseGenerationRequest)["mode"]))
    assert pause_modes == SGLANG_PAUSE_MODES
    finish_types = set(typing.get_args(typing.get_type_hints(wire.FinishReason)["type"]))
    assert finish_types == SGLANG_FINISH_TYPES


def test_what_the_engine_returns_uses_only_sglang_keys(dense):
    """A real response, with every optional part switched on, read key by key."""
    out = dense.generate({"input_ids": [1, 2, 3], "return_logprob": True, "rid": "schema",
                          "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [5]}})
    assert set(out) <= set(SGLANG_GENERATE_RESP)
    assert set(out["meta_info"]) <= set(SGLANG_META_INFO)
    assert set(out["meta_info"]["finish_reason"]) <= set(SGLANG_FINISH_REASON)
    assert all(len(entry) == 3 and isinstance(entry[1], int) for entry in out["meta_info"]["output_token_logprobs"])
    info = dense.get("/get_model_info").json()
    assert set(SGLANG_MODEL_INFO) <= set(info)
    assert info["architectures"] == ["LlamaForCausalLM"]
