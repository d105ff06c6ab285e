"""How an Anthropic Messages request reads into the chat messages a turn renders (no server: the
translation is a pure function; test_messages_api.py runs it end to end)."""

from __future__ import annotations

from typing import Any

import pytest
from miles_contracts.chat import ToolCall
from miles_tito.errors import InvalidRequest
from miles_tito.messages import ChatMessage
from miles_tito.server.messages_request import chat_messages, parse_messages_request


def read(messages: list[dict[str, Any]], **fields: Any) -> list[ChatMessage]:
    return chat_messages(parse_messages_request({"model": "m", "max_tokens": 4, "messages": messages, **fields}))


def test_blocks_map_onto_chat_roles_tool_messages_and_reasoning() -> None:
    out = read([
        {"role": "user", "content": [{"type": "text", "text": "6 * 7", "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": "s"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me compute."},
            {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "6 * 7"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "42"}], "is_error": True},
            {"type": "text", "text": "and now?"}]},
    ], system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}])
    assert out == [
        ChatMessage("system", "Be brief. Use tools."),
        ChatMessage("user", "6 * 7?"),
        ChatMessage("assistant", "Let me compute.", reasoning="use the tool",
                    tool_calls=(ToolCall("calculator", '{"expression": "6 * 7"}', "toolu_1"),)),
        ChatMessage("tool", "42", tool_call_id="toolu_1"),
        ChatMessage("user", "and now?"),
    ]


def test_tools_and_tool_choice_map_onto_the_chat_routes() -> None:
    tool = {"name": "calculator", "description": "arithmetic", "input_schema": {"type": "object"}}
    request = parse_messages_request({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                      "tools": [tool], "tool_choice": {"type": "none"}, "metadata": {"user_id": "u"}})
    assert request.tool_dicts == [{"type": "function", "function": {
        "name": "calculator", "description": "arithmetic", "parameters": {"type": "object"}}}]
    assert not request.parse_tool_calls  # "none": the text is returned as it is, as on the chat route
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "calculator"}):
        body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [tool], "tool_choice": choice}
        assert parse_messages_request(body).parse_tool_calls


@pytest.mark.parametrize(("messages", "field"), [
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "tool_result", "tool_use_id": "t"}]}],
     "messages.0.content.1"),  # results come first
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}],
     "messages.0.content.0.input"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}], "messages.0.content.0.id"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": 3}], "messages.0.content"),
    (["hi"], "messages.0"),
])
def test_malformed_blocks_name_the_field(messages: list[Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        read(messages)
    assert raised.value.param == field and raised.value.message.startswith(f"{field}:")


def test_a_tool_result_must_answer_the_previous_assistant_message() -> None:
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}
    assert read([{"role": "user", "content": "go"}, call, answer])[-1] == ChatMessage("tool", "ok", tool_call_id="toolu_1")
    with pytest.raises(InvalidRequest, match="toolu_1"):  # an older turn's id is not open any more
        read([{"role": "user", "content": "go"}, call, answer, {"role": "assistant", "content": "done"}, answer])
