"""Tool-using agents on each wire API, written with the official SDKs as their users write them:
ask, run the calculator for every call, send the results back, stop at an answer or after
``max_turns``. Each re-sends the whole history with the replies exactly as they came back.

Every agent is ``async (base_url, api_key, question, max_turns, max_tokens) -> int`` (the turns it
took); ``base_url`` is the session's OpenAI base URL (``.../sessions/<id>/v1``).
"""

from __future__ import annotations

import json
from typing import Any

from miles_tito.calculator import answer_call, openai_tool

SYSTEM = "Use the calculator tool for arithmetic, then state the answer."


async def chat_agent(base_url: str, api_key: str, question: str, max_turns: int, max_tokens: int) -> int:
    """OpenAI Chat Completions (``openai.AsyncOpenAI().chat.completions``)."""
    from openai import AsyncOpenAI

    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for turn in range(1, max_turns + 1):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[openai_tool()],  # type: ignore[list-item]
                                                         max_tokens=max_tokens)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return turn
            for call in message.tool_calls:
                arguments = call.function.arguments if call.type == "function" else "{}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer_call("calculator", arguments)})
    return max_turns


async def messages_agent(base_url: str, api_key: str, question: str, max_turns: int, max_tokens: int) -> int:
    """Anthropic Messages (``anthropic.AsyncAnthropic().messages``; the SDK adds ``/v1/messages``)."""
    from anthropic import AsyncAnthropic

    spec = openai_tool()["function"]
    tool = {"name": spec["name"], "description": spec.get("description", ""), "input_schema": spec["parameters"]}
    messages: list[Any] = [{"role": "user", "content": question}]
    async with AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0) as client:
        for turn in range(1, max_turns + 1):
            reply = await client.messages.create(model="policy", system=SYSTEM, messages=messages, tools=[tool],  # type: ignore[list-item]
                                                 max_tokens=max_tokens)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                return turn
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": answer_call("calculator", json.dumps(c.input))}
                for c in calls]})
    return max_turns


async def responses_agent(base_url: str, api_key: str, question: str, max_turns: int, max_tokens: int) -> int:
    """OpenAI Responses (``openai.AsyncOpenAI().responses``), the whole input re-sent every turn."""
    from openai import AsyncOpenAI

    spec = openai_tool()["function"]
    tool = {"type": "function", "name": spec["name"], "description": spec.get("description", ""),
            "parameters": spec["parameters"]}
    items: list[Any] = [{"role": "user", "content": question}]
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for turn in range(1, max_turns + 1):
            reply = await client.responses.create(model="policy", instructions=SYSTEM, input=items, tools=[tool],  # type: ignore[list-item]
                                                  max_output_tokens=max_tokens)
            items += [item.model_dump(exclude_none=True) for item in reply.output]
            calls = [item for item in reply.output if item.type == "function_call"]
            if not calls:
                return turn
            items += [{"type": "function_call_output", "call_id": c.call_id, "output": answer_call("calculator", c.arguments)}
                      for c in calls]
    return max_turns
