"""Small pieces: the calculator tool, message reading and matching, the chat-family contract."""

from __future__ import annotations

import pytest
from miles_contracts.chat import ChatFamily, ParsedTurn, tool_call_from_payload
from miles_tito.calculator import Calculator, evaluate
from miles_tito.messages import ChatMessage, MessageError


@pytest.mark.parametrize(("expression", "value"), [
    ("(12 + 30) * 2", "84"), ("7 / 2", "3.5"), ("2 ** 10", "1024"), ("-3 + +4", "1"), ("10 // 3", "3"), ("10 % 4", "2"),
    ("1 / 0", "error: division by zero"), ("2 ** 5000", "error: exponent 5000 is too large (limit 1000)"),
    ("__import__('os')", "error: unsupported element"), ("1 +", "error: '1 +' is not an arithmetic expression"),
])
def test_calculator(expression: str, value: str) -> None:
    assert evaluate(expression).startswith(value)


def test_calculator_is_a_tool() -> None:
    import asyncio

    assert asyncio.run(Calculator()(expression="6 * 7")) == "42"


def test_messages_read_openai_shapes() -> None:
    parts = ChatMessage.from_openai({"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, 0)
    assert (parts.role, parts.content) == ("system", "ab")
    call = ChatMessage.from_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}, 1)
    assert call.tool_calls[0].arguments == '{"x": 1}' and call.template_view["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call.to_openai()["content"] is None
    with pytest.raises(MessageError, match=r"messages\[3\]: only assistant messages carry tool_calls"):
        ChatMessage.from_openai({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, 3)


def test_an_echo_matches_but_an_edit_does_not() -> None:
    stored = ChatMessage.from_openai({"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}]}, 0)
    echo = ChatMessage.from_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}]}, 0)
    edit = ChatMessage.from_openai({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 3}'}}]}, 0)
    assert echo.matches(stored) and not edit.matches(stored)
    assert "tool calls" in edit.difference(stored)


def test_chat_family_contract_reports_every_problem() -> None:
    with pytest.raises(ValueError) as error:
        ChatFamily(name="x", template=" ", parse=lambda t: ParsedTurn(t), turn_end="", stop_tokens=(),
                   allowed_append_roles=frozenset({"robot"}), trim_trailing=("<x>",))
    message = str(error.value)
    for problem in ("template is empty", "stop_tokens is empty", "unknown roles ['robot']", "max_trim_tokens is 0"):
        assert problem in message


def test_tool_call_payloads() -> None:
    assert tool_call_from_payload({"name": "f", "arguments": '{"x": 1}'}).arguments == '{"x": 1}'
    for bad, problem in [([], "expected a JSON object"), ({"name": ""}, "no 'name'"), ({"name": "f", "arguments": "{"}, "not JSON")]:
        with pytest.raises(ValueError, match=problem):
            tool_call_from_payload(bad)
