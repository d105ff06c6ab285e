"""The agent: an ordinary OpenAI-client program. Nothing in it knows about RL or tokens.

It asks the model, runs the calculator when the model calls it, sends the result back, and stops
when the model answers without a tool call (or after ``max_turns``). Every request re-sends the
whole history, including the assistant messages exactly as the server returned them; the session
server turns that into token-exact training data.
"""

from __future__ import annotations

from typing import Any, cast

from miles_tito.calculator import answer_call, openai_tool
from openai import AsyncOpenAI
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

SYSTEM_PROMPT = "You are a careful math assistant. Use the calculator tool for arithmetic, then state the final answer."

CALCULATOR_TOOL = cast(ChatCompletionToolParam, openai_tool())
run_tool = answer_call  # the tool's answer as text; mistakes are answers too, so the model can recover


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
