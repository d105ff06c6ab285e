"""OpenAI Responses answers (whole and as server-sent events), built from a generated turn.

The assistant turn becomes output items in the order a chat template renders a turn: a
``reasoning`` item (the reasoning the family's parser split off, as ``reasoning_text`` content with
an empty ``summary``: an open model writes its reasoning, nobody summarises it), a ``message`` item
(one ``output_text`` part; left out when the text is empty and the model called tools, so a plain
turn always has one and ``response.output_text`` works) and one ``function_call`` item per parsed
tool call, whose ``call_id`` is the call id the session recorded. ``status`` is ``incomplete`` with
``incomplete_details.reason`` ``max_output_tokens`` when the length limit cut the turn.

As on the other routes, streaming is not incremental: the turn is generated and recorded whole,
then sent as the Responses event sequence (``response.created``, ``response.in_progress``; per item
``response.output_item.added``, its content events with one delta each, ``response.output_item.done``;
then ``response.completed``, or ``response.incomplete`` for a cut turn as OpenAI sends it), each with
a ``sequence_number``. The SDK's ``responses.stream`` helper assembles the same response.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from miles_tito.server.responses_request import ResponsesRequest
from miles_tito.turn import TurnResult


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def response(result: TurnResult, request: ResponsesRequest, *, response_id: str, model: str) -> dict[str, Any]:
    cut = result.record.finish_reason == "length"
    output_tokens = len(result.record.output_ids)
    return {
        "id": response_id, "object": "response", "created_at": int(result.record.created_at),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "model": model, "output": output_items(result),
        "instructions": request.instructions, "previous_response_id": request.previous_response_id,
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "tool_choice": _tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
        "max_output_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": {"type": "text"}}, "metadata": {},
        "usage": {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": result.prompt_tokens + output_tokens},
    }


def output_items(result: TurnResult) -> list[dict[str, Any]]:
    said = result.message
    status = "incomplete" if result.record.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if said.reasoning:
        items.append({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": said.reasoning}]})
    if said.content or not said.tool_calls:
        items.append({"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": said.content, "annotations": [], "logprobs": []}]})
    items += [{"type": "function_call", "id": _item_id("fc"), "call_id": c.id, "name": c.name,
               "arguments": c.arguments, "status": "completed"} for c in said.tool_calls]
    return items


def stream_events(result: TurnResult, request: ResponsesRequest, *, response_id: str, model: str) -> Iterator[bytes]:
    whole = response(result, request, response_id=response_id, model=model)
    counter = iter(range(1 << 62))

    def event(kind: str, **body: Any) -> bytes:
        data = {"type": kind, "sequence_number": next(counter), **body}
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    opening = {**whole, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    for index, item in enumerate(whole["output"]):
        yield event("response.output_item.added", output_index=index, item=_opened(item))
        yield from _item_content_events(event, index, item)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if whole["status"] == "incomplete" else "response.completed", response=whole)


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """The item as ``output_item.added`` announces it: in progress, before its content."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "function_call":
        return {**item, "status": "in_progress", "arguments": ""}
    return {**item, "content": []}


def _item_content_events(event: Any, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        part = item["content"][0]
        yield event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
        if part["text"]:
            yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
        yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
        yield event("response.content_part.done", **at, content_index=0, part=part)
    elif item["type"] == "function_call":
        yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
    else:
        text = item["content"][0]["text"]
        yield event("response.reasoning_text.delta", **at, content_index=0, delta=text)
        yield event("response.reasoning_text.done", **at, content_index=0, text=text)


def _tool_choice(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
