"""The OpenAI chat-completions request, as the session server accepts it.

Unknown fields are errors (a misspelt parameter must not silently do nothing), except the
parameters OpenAI clients routinely send that do not change generation (``user``, ``store`` ...),
which are accepted and ignored. SGLang/vLLM extensions that agents pass through ``extra_body`` are
supported: ``top_k``, ``min_tokens``, ``repetition_penalty``, ``chat_template_kwargs``.
"""

from __future__ import annotations

from typing import Any, Literal

from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import SessionSampling
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_tito.errors import InvalidRequest

IGNORED_FIELDS = frozenset({
    "user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options",
    "prediction", "modalities", "reasoning_effort", "web_search_options", "model",
})
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's own limit
"""Bounds of one request: the history is re-rendered each turn, tools are rendered into every prompt."""


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: dict[str, Any]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Any] = Field(max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    n: int = 1
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty: the engine has no logit bias
    include_usage: bool = False  # from stream_options

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump() for t in self.tools] if self.tools else None

    @property
    def parse_tool_calls(self) -> bool:
        return self.tool_choice != "none"

    def sampling(self, defaults: SessionSampling, default_max_tokens: int) -> SamplingParams:
        """Engine sampling: this request's values, else the session's defaults, else the engine's."""
        values: dict[str, Any] = {
            "max_new_tokens": self.max_completion_tokens or self.max_tokens or defaults.max_tokens or default_max_tokens,
            "temperature": _first(self.temperature, defaults.temperature),
            "top_p": _first(self.top_p, defaults.top_p),
            "top_k": _first(self.top_k, defaults.top_k),
            "min_new_tokens": self.min_tokens,
            "stop": _first(self.stop, defaults.stop),
            "sampling_seed": _first(self.seed, defaults.seed),
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise InvalidRequest(f"invalid sampling parameters: {_first_error(exc)}") from None


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    fields = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        fields["include_usage"] = True
    try:
        request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc), param=_first_loc(exc)) from None
    if request.n != 1:
        raise InvalidRequest(f"n={request.n} is not supported: a session is one conversation; open one session per sample", param="n")
    if request.logit_bias:
        raise InvalidRequest("logit_bias is not supported (the engine samples without per-token biases); "
                             "leave it out", param="logit_bias")
    if request.top_logprobs:
        raise InvalidRequest("top_logprobs is not supported; logprobs=true returns each sampled token's log-prob", param="top_logprobs")
    if request.response_format and request.response_format.get("type") not in (None, "text"):
        raise InvalidRequest("response_format other than text is not supported (no constrained decoding)", param="response_format")
    if isinstance(request.tool_choice, str) and request.tool_choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice {request.tool_choice!r}: use 'none', 'auto', 'required' or a function", param="tool_choice")
    return request


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown parameter {where!r}"
    return f"{where}: {error['msg']}" if where else error["msg"]


def _first_loc(exc: ValidationError) -> str | None:
    loc = exc.errors()[0]["loc"]
    return str(loc[0]) if loc else None
