"""Anthropic Messages answers (whole and as server-sent events) and errors, built from a generated turn.

The assistant message becomes content blocks in the order a chat template renders them: a
``thinking`` block (the reasoning the family's parser split off, with an empty ``signature``: no
one signs an open model's thoughts), a ``text`` block (left out when the text is empty) and one
``tool_use`` block per parsed tool call, whose ``id`` is the call id the session recorded and whose
``input`` is its arguments parsed (``{}`` when they are not a JSON object: Anthropic's ``input`` is
always one).

As on the chat route, streaming is not incremental: the turn is generated and recorded whole, then
sent as Anthropic's event sequence (``message_start``; per block ``content_block_start``, one
``content_block_delta``, ``content_block_stop``; ``message_delta`` with the stop reason and usage;
``message_stop``), which the SDKs' stream helpers assemble into the same message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from miles import bounded_json

from miles_tito.errors import TitoError
from miles_tito.turn import TurnResult

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def message(result: TurnResult, *, model: str) -> dict[str, Any]:
    stop_reason, stop_sequence = _stop(result)
    return {
        "id": _message_id(), "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(result),
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": len(result.record.output_ids)},
    }


def stream_events(result: TurnResult, *, model: str) -> Iterator[bytes]:
    whole = message(result, model=model)
    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}}
    yield _event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(whole["content"]):
        opening, delta = _block_start_and_delta(block)
        yield _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
        yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]},
                                   "usage": {"output_tokens": whole["usage"]["output_tokens"]}})
    yield _event("message_stop", {"type": "message_stop"})


def content_blocks(result: TurnResult) -> list[dict[str, Any]]:
    said = result.message
    blocks: list[dict[str, Any]] = []
    if said.reasoning:
        blocks.append({"type": "thinking", "thinking": said.reasoning, "signature": ""})
    if said.content:
        blocks.append({"type": "text", "text": said.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in said.tool_calls]
    return blocks


def error_body(error: TitoError) -> dict[str, Any]:
    """Anthropic's error shape; ``code`` and ``param`` are Miles' own (which check, which field)."""
    kind = _ERROR_TYPES.get(error.status_code, "invalid_request_error" if error.status_code < 500 else "api_error")
    return {"type": "error",
            "error": {"type": kind, "message": error.message, "code": error.code, "param": error.param}}


def _stop(result: TurnResult) -> tuple[str, str | None]:
    if result.record.finish_reason == "stop" and result.matched_stop:
        return "stop_sequence", result.matched_stop
    return _STOP_REASONS[result.record.finish_reason], None


def _block_start_and_delta(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    kind = block["type"]
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}, {"type": "thinking_delta", "thinking": block["thinking"]}
    if kind == "text":
        return {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
    return opening, {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}


def _input(arguments: str) -> dict[str, Any]:
    try:
        parsed = bounded_json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _event(name: str, body: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
