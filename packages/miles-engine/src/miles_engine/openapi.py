"""The engine's OpenAPI document, built from its route table (``GET /openapi.json``, token needed).

The routes validate their JSON bodies themselves (for SGLang's error shapes), so FastAPI cannot
see their request models; this table says which wire model each route takes, and the document is
built from it and the models' JSON schemas. Schemathesis runs against it in the test suite
(``tests/security/test_fuzz.py``), which is how the table is kept honest.
"""

from __future__ import annotations

from typing import Any

from miles_contracts.wire.engine import (
    CONTROL,
    ENGINE_ROUTES,
    AbortRequest,
    CheckWeightsRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from miles_contracts.wire.mooncake import UpdateWeightsFromMooncakeRequest
from pydantic import BaseModel, ConfigDict

_REF = "#/components/schemas/{model}"


class FillWeightsNoiseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0


# path -> (methods, request model or None, one-line summary)
ROUTE_SPECS: dict[str, tuple[tuple[str, ...], type[BaseModel] | None, str]] = {
    "/health": (("GET",), None, "200 when the engine can serve; 503 while paused or stopped"),
    "/generate": (("POST",), GenerateRequest, "generate from text or token ids"),
    "/health_generate": (("GET",), None, "generate one token as a probe"),
    "/model_info": (("GET",), None, "model, weight version, vocabulary"),
    "/get_model_info": (("GET",), None, "model, weight version, vocabulary (SGLang's older name)"),
    "/server_info": (("GET",), None, "engine settings and batching statistics"),
    "/get_server_info": (("GET",), None, "engine settings and batching statistics (SGLang's older name)"),
    "/abort_request": (("POST",), AbortRequest, "abort one request (rid) or all"),
    "/pause_generation": (("POST",), PauseGenerationRequest, "hold generation (abort, retract or in place)"),
    "/continue_generation": (("POST",), ContinueGenerationRequest, "resume generation"),
    "/flush_cache": (("GET", "POST"), None, "drop the KV cache when idle"),
    "/update_weights_from_disk": (("POST",), UpdateWeightsFromDiskRequest, "load safetensors from an allowed folder"),
    "/update_weights_from_tensor": (("POST",), UpdateWeightsFromTensorRequest, "load tensors shared on this host"),
    "/init_weights_update_group": (("POST",), InitWeightsUpdateGroupRequest, "join a weight broadcast group"),
    "/destroy_weights_update_group": (("POST",), DestroyWeightsUpdateGroupRequest, "leave a weight broadcast group"),
    "/update_weights_from_distributed": (("POST",), UpdateWeightsFromDistributedRequest, "receive a broadcast"),
    "/update_weights_from_mooncake": (("POST",), UpdateWeightsFromMooncakeRequest, "pull a bucket over Mooncake"),
    "/update_weight_version": (("POST",), UpdateWeightVersionRequest, "set the weight version"),
    "/weights_checker": (("GET", "POST"), CheckWeightsRequest, "check mode: snapshot, reset, compare, checksum"),
    "/release_memory_occupation": (("GET", "POST"), MemoryOccupationRequest, "give weights / KV memory back"),
    "/resume_memory_occupation": (("GET", "POST"), MemoryOccupationRequest, "take the memory back"),
    "/fill_weights_noise": (("POST",), FillWeightsNoiseRequest, "check mode: weights become noise"),
    "/weights_checksum": (("GET",), None, "check mode: SHA-256 of every weight"),
}


def engine_openapi(title: str = "miles embedded engine", version: str = "0.1.0") -> dict[str, Any]:
    """OpenAPI 3.1 for every route of :data:`ROUTE_SPECS`; every route but ``/health`` needs the bearer token."""
    schemas: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    for path, (methods, model, summary) in ROUTE_SPECS.items():
        operations = {}
        for method in methods:
            operation: dict[str, Any] = {
                "summary": summary, "tags": [ENGINE_ROUTES[path]],
                "operationId": f"{method.lower()}_{path.strip('/')}",
                "responses": _responses(path, model is not None),
            }
            if path == "/health":
                operation["security"] = []
            if model is not None and method == "POST":
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                operation["requestBody"] = {"required": path != "/pause_generation", "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}
            operations[method.lower()] = operation
        paths[path] = operations
    return {
        "openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def _responses(path: str, has_body: bool) -> dict[str, Any]:
    answers: dict[str, Any] = {"200": {"description": "done"}}
    if path != "/health":
        answers["401"] = {"description": "missing or wrong token"}
    if has_body:
        answers.update({"400": {"description": "invalid request; the detail says what to change"},
                        "413": {"description": "body over the size limit"},
                        "415": {"description": "body is not JSON"}})
    if ENGINE_ROUTES[path] == CONTROL:
        answers["403"] = {"description": "refused (e.g. a same-host format from another host)"}
    answers["503"] = {"description": "the engine cannot serve (paused, shutting down)"}
    return answers
