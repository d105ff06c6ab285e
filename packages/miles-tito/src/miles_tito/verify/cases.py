"""Canned conversations ``miles verify-template`` renders at every split point.

Each is a finished conversation in OpenAI form (ending with an assistant turn) with the tools it
offers. Together they cover what real agents do to a template: tool calls alone, in parallel and
in long chains, thinking with and without tools, a harness message after a failed call (retry),
system messages mid-way, and empty assistant content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in properties.items()},
                "required": list(properties),
            },
        },
    }


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _calls(content: str, *calls: dict[str, Any], reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": list(calls)}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _say(content: str, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


CALCULATOR = _tool("calculator", "Evaluate an arithmetic expression.", expression="string")
WEATHER = _tool("weather", "Current weather of a city.", city="string")
SYSTEM = {"role": "system", "content": "You are a careful assistant. Use tools when they help."}

CASES: tuple[Case, ...] = (
    Case("plain_chat", (
        SYSTEM,
        {"role": "user", "content": "Name a prime number."},
        _say("7 is prime."),
        {"role": "user", "content": "And an even one?"},
        _say("2 is the only even prime."),
    )),
    Case("no_system_message", (
        {"role": "user", "content": "Hi!"},
        _say("Hello! How can I help?"),
        {"role": "user", "content": "Tell me a joke."},
        _say("Why did the integer cross the road? To get to the other side of zero."),
    )),
    Case("single_tool_call", (
        SYSTEM,
        {"role": "user", "content": "What is 17 * 23?"},
        _calls("", _call("c1", "calculator", '{"expression": "17 * 23"}')),
        _result("c1", "391"),
        _say("17 * 23 = 391."),
    ), (CALCULATOR,)),
    Case("parallel_tool_calls", (
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        _calls("Checking both.", _call("c1", "weather", '{"city": "Paris"}'), _call("c2", "weather", '{"city": "Tokyo"}')),
        _result("c1", "Paris: 18C, cloudy"),
        _result("c2", "Tokyo: 24C, sunny"),
        _say("Paris is 18C and cloudy; Tokyo is 24C and sunny."),
    ), (WEATHER,)),
    Case("long_tool_chain", (
        SYSTEM,
        {"role": "user", "content": "Compute ((2 + 3) * 4 - 5) / 3 step by step with the calculator."},
        *[
            message
            for k, (expr, value) in enumerate([("2 + 3", "5"), ("5 * 4", "20"), ("20 - 5", "15"), ("15 / 3", "5"), ("5 + 0", "5"), ("5 * 1", "5")])
            for message in (_calls(f"Step {k + 1}.", _call(f"c{k}", "calculator", f'{{"expression": "{expr}"}}')), _result(f"c{k}", value))
        ],
        _say("The result is 5."),
    ), (CALCULATOR,)),
    Case("thinking", (
        {"role": "user", "content": "Is 91 prime?"},
        _say("No: 91 = 7 * 13.", reasoning="91 / 7 = 13, so it has a divisor."),
        {"role": "user", "content": "Is 97 prime?"},
        _say("Yes, 97 is prime.", reasoning="Check 2, 3, 5, 7: none divides 97."),
        {"role": "user", "content": "Thanks."},
        _say("You're welcome!", reasoning="Nothing to compute."),
    )),
    Case("thinking_with_tools", (
        SYSTEM,
        {"role": "user", "content": "What is 123 * 456 + 789?"},
        _calls("", _call("c1", "calculator", '{"expression": "123 * 456"}'), reasoning="First the product."),
        _result("c1", "56088"),
        _calls("", _call("c2", "calculator", '{"expression": "56088 + 789"}'), reasoning="Now add 789."),
        _result("c2", "56877"),
        _say("123 * 456 + 789 = 56877.", reasoning="Done."),
    ), (CALCULATOR,)),
    Case("retry_after_failed_call", (
        {"role": "user", "content": "What is 2 to the power 10?"},
        _calls("", _call("c1", "calculator", '{"expr": "2^10"}')),
        _result("c1", "error: wrong arguments for calculator: unexpected keyword argument 'expr'"),
        {"role": "user", "content": "Your tool call failed; fix the arguments and try again."},
        _calls("", _call("c2", "calculator", '{"expression": "2 ** 10"}')),
        _result("c2", "1024"),
        _say("2^10 = 1024."),
    ), (CALCULATOR,)),
    Case("system_message_midway", (
        SYSTEM,
        {"role": "user", "content": "Say hello."},
        _say("Hello."),
        {"role": "system", "content": "From now on answer in French."},
        {"role": "user", "content": "Say hello again."},
        _say("Bonjour."),
    )),
    Case("empty_assistant_content", (
        {"role": "user", "content": "Weather in Oslo?"},
        _calls("", _call("c1", "weather", '{"city": "Oslo"}')),
        _result("c1", "Oslo: -3C, snow"),
        _say(""),
        {"role": "user", "content": "Hello?"},
        _say("It is -3C and snowing in Oslo."),
    ), (WEATHER,)),
)
