"""The agent: an ordinary OpenAI-client program. Nothing in it knows about RL or tokens.

It asks the model, runs the calculator when the model calls it, sends the result back, and stops
when the model answers without a tool call (or after ``max_turns``). Every request re-sends the
whole history, including the assistant messages exactly as the server returned them; the session
server turns that into token-exact training data.
"""

from __future__ import annotations

import json
from typing import Any, cast

from miles_tito.calculator import evaluate
from openai import AsyncOpenAI
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

SYSTEM_PROMPT = "You are a careful math assistant. Use the calculator tool for arithmetic, then state the final answer."

CALCULATOR_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly, e.g. '(12 + 30) * 2'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
            "required": ["expression"],
        },
    },
}


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer as text; mistakes are answers too, so the model can recover from them."""
    if name != "calculator":
        return f"error: there is no tool named {name!r}; use calculator"
    try:
        expression = json.loads(arguments).get("expression")
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object with an 'expression' string"
    if not isinstance(expression, str):
        return "error: 'expression' must be a string"
    return evaluate(expression)


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None``.

    :param base_url: the session's OpenAI base URL (``.../sessions/<id>/v1``).
    :param prompt: the task as OpenAI messages (or a string).
    :param request_kwargs: sampling settings of the run, passed to every request.
    :param metadata: the sample's metadata; ``api_key`` is the session's key (the OpenAI client's
        ``api_key``), ``max_turns`` caps the tool loop (default 4).
    """
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    max_turns = int(metadata.get("max_turns", 4))
    calls = 0
    async with AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client:
        for turn in range(1, max_turns + 1):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL], **request_kwargs)
            choice = response.choices[0]
            # the assistant turn, as returned
            messages.append(cast(ChatCompletionAssistantMessageParam, choice.message.model_dump(exclude_none=True)))
            if not choice.message.tool_calls:
                return {"answer": choice.message.content, "turns": turn, "tool_calls": calls, "finish_reason": choice.finish_reason}
            for call in choice.message.tool_calls:
                if call.type != "function":
                    raise TypeError(f"unexpected {call.type!r} tool call: the agent offers only the calculator function")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name, call.function.arguments)})
                calls += 1
    return {"answer": None, "turns": max_turns, "tool_calls": calls, "finish_reason": "max_turns"}
