"""The inference-engine HTTP API: the subset of SGLang's native API that Miles uses.

Field names and shapes follow SGLang (``GenerateReqInput``, ``SamplingParams``, ``meta_info``), so
the embedded engine and a real SGLang server are interchangeable behind the router. Requests reject
unknown fields (a typo must not silently do nothing); responses allow extra fields, since SGLang
adds keys across versions.

``POST /generate``   :class:`GenerateRequest` -> :class:`GenerateResponse`
``POST /abort_request``  :class:`AbortRequest` -> 200, empty body
``POST /pause_generation`` :class:`PauseGenerationRequest` / ``/continue_generation``
:class:`ContinueGenerationRequest` -> ``{"message", "status": "ok"}``
``POST /flush_cache`` -> 200 (plain text), 400 when requests are still queued or running
``POST /update_weights_from_disk``  :class:`UpdateWeightsFromDiskRequest`
``POST /update_weights_from_tensor``  :class:`UpdateWeightsFromTensorRequest`
``POST /init_weights_update_group``  :class:`InitWeightsUpdateGroupRequest`
``POST /destroy_weights_update_group``  :class:`DestroyWeightsUpdateGroupRequest`
``POST /update_weights_from_distributed``  :class:`UpdateWeightsFromDistributedRequest`
``POST /update_weight_version``  :class:`UpdateWeightVersionRequest`
``POST /weights_checker``  :class:`CheckWeightsRequest` (check mode: snapshot, noise, compare)
``POST /release_memory_occupation`` / ``/resume_memory_occupation``  :class:`MemoryOccupationRequest`
``GET /health``, ``/health_generate`` (200, body not part of the API), ``/model_info`` -> :class:`ModelInfo`,
``/server_info`` (``tp_size`` and engine settings)

Weight updates answer ``{"success": bool, "message": str}`` with 200, or 400 and ``"success": false``.
``miles_contracts.testing.engine`` checks an engine against all of this; docs/design/engine-api.md
says where SGLang's behaviour is subtle (pause modes, cache flushes, abort by rid prefix).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""Header the router reads for session affinity (the same key reaches the same engine)."""

HEALTH, DATA, CONTROL = "health", "data", "control"
ENGINE_ROUTES: dict[str, str] = {
    "/health": HEALTH,
    "/generate": DATA,
    "/health_generate": DATA,  # runs a generation: it costs the engine work, so it needs the token
    "/model_info": DATA,
    "/get_model_info": DATA,  # SGLang's older names of the two info routes
    "/server_info": DATA,
    "/get_server_info": DATA,
    "/abort_request": CONTROL,
    "/pause_generation": CONTROL,
    "/continue_generation": CONTROL,
    "/flush_cache": CONTROL,
    "/update_weights_from_disk": CONTROL,
    "/update_weights_from_tensor": CONTROL,
    "/init_weights_update_group": CONTROL,
    "/destroy_weights_update_group": CONTROL,
    "/update_weights_from_distributed": CONTROL,
    "/update_weights_from_mooncake": CONTROL,
    "/update_weight_version": CONTROL,
    "/weights_checker": CONTROL,
    "/release_memory_occupation": CONTROL,
    "/resume_memory_occupation": CONTROL,
    "/fill_weights_noise": CONTROL,
    "/weights_checksum": CONTROL,
}
"""Every engine route by kind: ``health`` answers anyone (liveness only), ``data`` serves
generation to the run's clients, ``control`` changes what the engine serves (weights, pause,
aborts, process groups). Both data and control need the run's token; the kinds are kept apart so
that a deployment can expose or proxy one without the other (see docs/design/security.md)."""


INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 2048
MAX_STOP_TOKEN_IDS = 4096
"""Limits of :class:`SamplingParams`: each stop string is matched against the text at every
decode step, so their number bounds the per-token cost one request may impose on its batch."""

MIN_REPETITION_PENALTY = 0.01
"""The smallest ``repetition_penalty`` taken (SGLang takes [0, 2]). The penalty divides the
positive logits of seen tokens, so a value near zero sends them to infinity (1e-39 made every
log-prob NaN, sent as ``null``, and the argmax one token repeated). At 0.01 a seen token's logit
grows at most 100-fold: a model's logits (tens, at most thousands) stay far inside float32 and even
float16 (65,504), and a token already 100 times more likely is as repeated as a penalty can make it."""

MAX_NAME_CHARS = 256
MAX_WEIGHT_GROUP_RANKS = 2**16
"""A weight group's largest ``world_size``: the trainer and every engine rank of a fleet, with
room to spare; gloo and NCCL keep per-rank state, so a typo must not ask for billions of ranks."""


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable text: no newlines, tabs or other control characters")
    return value


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_printable)]
"""A weight version or a process-group name: 1 to 256 printable characters. Both are echoed in
answers and logs, and the router compares versions on every probe: an empty one is no version,
and a megabyte one a megabyte per probe and per log line."""

StrictCount = Annotated[int, Field(strict=True)]
"""A JSON integer and nothing else: pydantic's default (lax) mode takes ``"1"`` and ``true`` as 1,
which turned ``input_ids: [false]`` into token 0 and ``max_new_tokens: true`` into one token."""

FilePath = Annotated[str, Field(min_length=1, max_length=4096)]
"""A path on the engine's host (4096: Linux's PATH_MAX); a NUL byte is refused where it is used."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingParams(_Request):
    """SGLang sampling parameters. ``temperature == 0`` means greedy; ``top_k == -1`` means off.

    Every field is bounded to what the sampling kernels accept (ints fit int32, seeds a torch
    generator, penalties SGLang's ranges -- ``repetition_penalty`` from
    :data:`MIN_REPETITION_PENALTY` --, floats finite), so a request that validates cannot fail
    inside a batched step and take its batch-mates with it, nor answer non-finite log-probs.
    Integers must be JSON integers (:data:`StrictCount`).
    """

    max_new_tokens: StrictCount = Field(default=128, ge=0, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictCount = Field(default=-1, ge=-1, le=INT32_MAX)
    min_new_tokens: StrictCount = Field(default=0, ge=0, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictCount] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: StrictCount | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=2.0)

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}")
        long_stops = [s for s in self.stop_strings if len(s) > MAX_STOP_STRING_CHARS]
        if long_stops:
            raise ValueError(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters; one has {len(long_stops[0])}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateRequest(_Request):
    """``POST /generate``. Exactly one of ``text`` and ``input_ids``.

    ``return_routed_experts`` asks a MoE model for the experts each position was routed to (see
    :attr:`MetaInfo.routed_experts`); ``routed_experts_start_len`` (SGLang's name and meaning)
    is the first position to report, at most the prompt's length: a later turn of a conversation
    asks only for the positions the earlier turns did not report.
    """

    text: str | None = None
    input_ids: list[StrictCount] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = Field(default=None, max_length=256)
    return_logprob: bool = False
    logprob_start_len: StrictCount = Field(default=-1, ge=-1, le=INT32_MAX)
    return_routed_experts: bool = False
    routed_experts_start_len: StrictCount = Field(default=0, ge=0, le=INT32_MAX)
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' and 'input_ids'")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("'input_ids' is empty")
        return self


class FinishReason(_Response):
    """``{"type": "stop", "matched": <id or str>}``, ``{"type": "length", "length": n}`` or
    ``{"type": "abort", "message": "..."}``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None  # SGLang may report several matched token ids
    length: int | None = None
    message: str | None = None
    status_code: int | None = None


class MetaInfo(_Response):
    """``meta_info`` of a generate response.

    :ivar output_token_logprobs: one ``[logprob, token_id, text_or_null]`` per output token.
    :ivar routed_experts: base64 of the little-endian int32 array
        ``[prompt_tokens + completion_tokens - 1 - routed_experts_start_len, layers, top_k]`` (see
        :func:`encode_routed_experts`): row ``i`` holds the experts position
        ``routed_experts_start_len + i`` was routed to; the last sampled token was never fed, so it
        has no row. This is SGLang's encoding (``meta_info["routed_experts"]``, filled when the
        server runs with ``--enable-return-routed-experts``), where ``layers`` is the model's
        ``num_hidden_layers`` with dense layers' rows zero; an engine may instead report the MoE
        layers only. MoE models only.
    """

    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int = 0  # SGLang leaves it out for a request aborted while queued
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | int | None = None
    output_token_logprobs: list[list[Any]] | None = None
    routed_experts: str | None = None
    e2e_latency: float | None = None


class GenerateResponse(_Response):
    text: str = ""  # SGLang started with --skip-tokenizer-init answers token ids only
    output_ids: list[int]
    meta_info: MetaInfo

    def logprobs(self) -> list[float]:
        """Log-prob of each output token (``[completion_tokens]``)."""
        return [float(entry[0]) for entry in self.meta_info.output_token_logprobs or []]


class AbortRequest(_Request):
    rid: str = ""
    abort_all: bool = False


PauseMode = Literal["abort", "retract", "in_place"]
"""SGLang's pause modes: ``abort`` ends every in-flight request (finish reason ``abort``);
``retract`` moves running requests back to the queue and drops their KV (recomputed on continue);
``in_place`` freezes the running batch with its KV. In every mode new requests wait until
``/continue_generation``."""


class PauseGenerationRequest(_Request):
    mode: PauseMode = "abort"


class ContinueGenerationRequest(_Request):
    torch_empty_cache: bool = True


class UpdateWeightsFromDiskRequest(_Request):
    model_path: FilePath
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: Name | None = None
    flush_cache: bool = True


class UpdateWeightsFromTensorRequest(_Request):
    """``serialized_named_tensors``: one payload per engine TP rank; the embedded engine has one.
    Each payload is base64 of a pickle made by ``torch.multiprocessing`` reductions (shared memory
    on CPU, CUDA IPC handles on GPU) of ``list[(name, tensor)]``."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Name | None = None


class InitWeightsUpdateGroupRequest(_Request):
    """Join a weight-broadcast group as ranks ``rank_offset ...``; the trainer hosts it (rank 0)
    at ``master_address:master_port``."""

    master_address: Name
    master_port: StrictCount = Field(ge=1, le=65535)
    rank_offset: StrictCount = Field(ge=0, lt=MAX_WEIGHT_GROUP_RANKS)
    world_size: StrictCount = Field(ge=1, le=MAX_WEIGHT_GROUP_RANKS)
    group_name: Name = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Request):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[StrictCount]]
    group_name: Name = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Name | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupRequest(_Request):
    group_name: Name = "weight_update_group"


class UpdateWeightVersionRequest(_Request):
    """SGLang aborts every request by default here: a client that pauses first sends ``false``."""

    new_version: Name
    abort_all_requests: bool = True


CheckWeightsAction = Literal["snapshot", "reset_tensors", "compare", "checksum"]


class CheckWeightsRequest(_Request):
    """``POST /weights_checker``: ``snapshot`` keeps a copy of every weight, ``reset_tensors`` fills
    the weights with random values, ``compare`` answers 400 unless every weight equals its snapshot
    bit for bit, ``checksum`` answers per-tensor checksums in the engine's own tensor names."""

    action: CheckWeightsAction = "checksum"


MemoryTag = Literal["weights", "kv_cache", "cuda_graph"]


class MemoryOccupationRequest(_Request):
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` (idle engines only);
    ``tags`` ``None`` means all of them."""

    tags: list[MemoryTag] | None = None


class UpdateWeightsResponse(_Response):
    success: bool
    message: str = ""


class ModelInfo(_Response):
    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | int | None = None


def encode_routed_experts(data: bytes) -> str:
    """Routed experts on the wire: base64 of the raw little-endian int32 buffer."""
    return base64.b64encode(data).decode("ascii")


def decode_routed_experts(payload: str) -> bytes:
    return base64.b64decode(payload)
