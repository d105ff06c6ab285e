"""How an OpenAI Responses request reads into the chat messages a turn renders (no server: the
translation is a pure function; test_responses_api.py runs it end to end)."""

from __future__ import annotations

from typing import Any

import pytest
from miles_contracts.chat import ToolCall
from miles_tito.errors import InvalidRequest
from miles_tito.messages import ChatMessage
from miles_tito.server.responses_request import chat_messages, parse_responses_request

CALL = {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "6 * 7"}',
        "id": "fc_1", "status": "completed"}


def read(input_: Any, history: tuple[ChatMessage, ...] = (), **fields: Any) -> list[ChatMessage]:
    prompt, _ = chat_messages(parse_responses_request({"model": "m", "input": input_, **fields}), history)
    return prompt


def test_items_map_onto_chat_roles_one_assistant_turn_and_tool_messages() -> None:
    out = read([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "6 * 7"},
                                                        {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "a summary"}],
         "content": [{"type": "reasoning_text", "text": "use the tool"}], "encrypted_content": "opaque"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me compute.", "annotations": [], "logprobs": []}]},
        CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"role": "user", "content": "and now?"},
    ], instructions="Use tools.")
    assert out == [
        ChatMessage("system", "Use tools."),
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "6 * 7?"),
        ChatMessage("assistant", "Let me compute.", reasoning="use the tool",
                    tool_calls=(ToolCall("calculator", '{"expression": "6 * 7"}', "call_1"),)),
        ChatMessage("tool", "42", tool_call_id="call_1"),
        ChatMessage("user", "and now?"),
    ]


def test_a_reasoning_item_without_content_reads_its_summary_and_a_new_reasoning_item_opens_a_turn() -> None:
    out = read([
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "first"}]},
        {"role": "assistant", "content": "one"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "second"}]},
        {"role": "assistant", "content": "two"},
    ])
    assert out[1:] == [ChatMessage("assistant", "one", reasoning="first"), ChatMessage("assistant", "two", reasoning="second")]


def test_an_empty_reasoning_item_is_no_reasoning() -> None:
    """OpenAI's own reasoning items carry only encrypted_content: echoed, they must not read as a
    rewritten turn (reasoning "" against a recorded turn without reasoning)."""
    out = read([{"role": "user", "content": "go"}, {"type": "reasoning", "summary": [], "encrypted_content": "x"},
                {"role": "assistant", "content": "ok"}])
    assert out[1] == ChatMessage("assistant", "ok") and out[1].matches(ChatMessage("assistant", "ok"))


def test_a_continuation_appends_to_the_remembered_conversation_with_the_new_instructions() -> None:
    history = (ChatMessage("user", "6 * 7?"),
               ChatMessage("assistant", "", tool_calls=(ToolCall("calculator", "{}", "call_1"),)))
    request = parse_responses_request({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"}],
                                       "instructions": "Now in French.", "previous_response_id": "resp_1"})
    prompt, conversation = chat_messages(request, history)
    assert prompt == [ChatMessage("system", "Now in French."), *history, ChatMessage("tool", "42", tool_call_id="call_1")]
    assert conversation == prompt[1:]  # what the next response is remembered with: no instructions


def test_flat_tools_become_the_chat_routes_nested_specs() -> None:
    tool = {"type": "function", "name": "calculator", "description": "arithmetic", "parameters": {"type": "object"},
            "strict": True}
    request = parse_responses_request({"input": "x", "tools": [tool], "tool_choice": "none", "store": False,
                                       "metadata": {"k": "v"}, "user": "u", "parallel_tool_calls": False})
    assert request.tool_dicts == [{"type": "function", "function": {
        "name": "calculator", "description": "arithmetic", "parameters": {"type": "object"}}}]
    assert not request.parse_tool_calls  # "none": the text is returned as it is, as on the chat route
    assert parse_responses_request({"input": "x", "tools": [tool], "tool_choice": {"type": "function", "name": "calculator"}}).parse_tool_calls


@pytest.mark.parametrize(("input_", "field"), [
    ([{"type": "function_call_output", "call_id": "call_1", "output": "42"}], "input.0.call_id"),  # no call before it
    ([CALL, {"role": "assistant", "content": "done"}, {"type": "function_call_output", "call_id": "call_1", "output": "42"}],
     "input.2.call_id"),  # an older turn's call is not open any more
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ([{"type": "reasoning", "summary": [{"type": "summary_text"}]}], "input.0.summary.0.text"),
    ([{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
    ([{"role": "user", "content": 3}], "input.0.content"),
    (["hi"], "input.0"),
])
def test_malformed_items_name_the_field(input_: list[Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        read(input_)
    assert raised.value.param == field and raised.value.message.startswith(f"{field}:")


def test_the_item_bound_counts_items_not_the_characters_of_a_string_input() -> None:
    assert read("x" * 5000) == [ChatMessage("user", "x" * 5000)]
    with pytest.raises(InvalidRequest) as raised:
        read([{"role": "user", "content": "x"}] * 4097)
    assert raised.value.param == "input" and "4097 items" in raised.value.message


@pytest.mark.parametrize(("fields", "field"), [
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools.0.type"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
])
def test_unsupported_parameters_name_the_parameter(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        parse_responses_request({"input": "x", **fields})
    assert raised.value.param == field


def test_reasoning_renders_where_the_template_has_a_place_for_it(qwen3: Any, chatml: Any) -> None:
    """The Messages route's rule for thinking blocks: Qwen3's template renders the reasoning of the
    turn in progress, ChatML's (SmolLM2's) has no place for it and drops it."""
    items = [{"role": "user", "content": "6 * 7?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "use the tool"}]},
             CALL, {"type": "function_call_output", "call_id": "call_1", "output": "42"}]
    messages = read(items)
    assert "use the tool" in qwen3.render(messages, None, add_generation_prompt=True)
    assert "use the tool" not in chatml.render(messages, None, add_generation_prompt=True)
