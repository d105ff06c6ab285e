"""OpenAI chat-completion answers (whole and as server-sent events) built from a generated turn.

Streaming is accepted but not incremental: the turn is generated whole (its tokens must be checked
and recorded before anything is final), then sent as a role chunk, a content chunk, one chunk per
tool call, a finish chunk, an optional usage chunk and ``[DONE]``. Clients that stream get the same
message they would get without streaming.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from miles_tito.errors import TitoError
from miles_tito.server.schema import ChatCompletionRequest
from miles_tito.tokenizer import TitoTokenizer
from miles_tito.turn import TurnResult


def completion(result: TurnResult, request: ChatCompletionRequest, *, model: str, tito: TitoTokenizer) -> dict[str, Any]:
    record = result.record
    choice: dict[str, Any] = {"index": 0, "message": result.message.to_openai(), "finish_reason": record.finish_reason}
    choice["logprobs"] = _logprobs(result, tito) if request.logprobs else None
    return {
        "id": _completion_id(result),
        "object": "chat.completion",
        "created": int(record.created_at),
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
    }


def stream_events(result: TurnResult, request: ChatCompletionRequest, *, model: str, tito: TitoTokenizer) -> Iterator[bytes]:
    base = {"id": _completion_id(result), "object": "chat.completion.chunk", "created": int(result.record.created_at), "model": model}
    message = result.message.to_openai()

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        return _event(body)

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        logprobs = _logprobs(result, tito) if request.logprobs else None
        yield chunk({"content": message["content"]}, logprobs=logprobs)
    for index, call in enumerate(message.get("tool_calls") or ()):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, result.record.finish_reason)
    if request.include_usage:
        yield _event({**base, "choices": [], "usage": _usage(result)})
    yield b"data: [DONE]\n\n"


def error_body(error: TitoError) -> dict[str, Any]:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def _completion_id(result: TurnResult) -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _usage(result: TurnResult) -> dict[str, int]:
    completion_tokens = len(result.record.output_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": result.prompt_tokens + completion_tokens,
    }


def _logprobs(result: TurnResult, tito: TitoTokenizer) -> dict[str, Any]:
    tokens = tito.tokenizer.convert_ids_to_tokens(result.record.output_ids)
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": None, "top_logprobs": []}
            for token, logprob in zip(tokens, result.record.output_logprobs, strict=True)
        ]
    }
