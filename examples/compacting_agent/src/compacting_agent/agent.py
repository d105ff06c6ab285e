"""The agent: a tool loop with the official ``openai`` client that compacts its context.

Each turn it asks the model; a calculator call is answered with the tool's result, a reply with a
final answer (``Answer: ...``) ends the episode, anything else gets a nudge to go on. Every
``compact_every`` turns it throws the history away and starts over from ``[system, user: "Summary
so far: ... Task: ..."]``, as long-running agents do when their context fills up.

The session server sees a request that does not extend the conversation it recorded and is shorter
than it: a fork with cause ``compaction``. Every turn before it stays in the episode's graph on its
own branch, so its tokens are trained too (in the row of that branch), and the turns after it form
the episode's primary branch (the one the reward reads).
"""

from __future__ import annotations

import re
from typing import Any, cast

from miles_tito.calculator import answer_call, openai_tool
from openai import AsyncOpenAI
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

SYSTEM_PROMPT = ("You are a careful math assistant. Use the calculator tool for arithmetic. When you are sure, "
                 "reply with 'Answer: <number>'.")
# Longer than the summary's fixed text: a compaction always shrinks the history (what the session
# server reads as the cause "compaction" rather than "rewrite").
NUDGE = "That is not a final answer yet. Keep working on the task, then reply with 'Answer: <number>' on its own line."
SUMMARY_NOTE_CHARS = 40
DEFAULT_COMPACT_EVERY = 2
_FINAL = re.compile(r"answer\s*:", re.IGNORECASE)

CALCULATOR_TOOL = cast(ChatCompletionToolParam, openai_tool())
run_tool = answer_call  # the tool's answer as text; mistakes are answers too, so the model can recover


def summary(task: str, turns: int, notes: list[str]) -> str:
    """The user message a compacted history starts with: what was done (briefly), then the task."""
    last = " ".join(notes[-1].split())[:SUMMARY_NOTE_CHARS] if notes else ""
    return f"Summary so far: {turns} turns done; last note: {last!r}.\n\nTask: {task}"


def compact_every_of(metadata: dict[str, Any]) -> int:
    value = int(metadata.get("compact_every", DEFAULT_COMPACT_EVERY))
    if value < 1:
        raise ValueError(f'metadata["compact_every"] must be at least 1 (turns between compactions), got {value}')
    return value


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict``.

    :param metadata: ``api_key`` (the session's key), ``max_turns`` (default 6) and
        ``compact_every`` (turns between compactions, default 2).
    """
    task = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    system: ChatCompletionMessageParam = {"role": "system", "content": SYSTEM_PROMPT}
    messages: list[ChatCompletionMessageParam] = [system, {"role": "user", "content": task}]
    max_turns, compact_every = int(metadata.get("max_turns", 6)), compact_every_of(metadata)
    notes: list[str] = []
    compactions = since_compaction = 0
    async with AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client:
        for turn in range(1, max_turns + 1):
            if since_compaction == compact_every:
                messages = [system, {"role": "user", "content": summary(task, turn - 1, notes)}]
                compactions, since_compaction = compactions + 1, 0
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                                            **request_kwargs)
            since_compaction += 1
            message = response.choices[0].message
            # the assistant turn exactly as returned: the server recognises its own turn in the history
            messages.append(cast(ChatCompletionAssistantMessageParam, message.model_dump(exclude_none=True)))
            content = message.content or ""
            notes.append(content)
            if message.tool_calls:
                for call in message.tool_calls:
                    result = run_tool(call.function.name, call.function.arguments) if call.type == "function" else "error: unknown call"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            elif _FINAL.search(content):
                return {"answer": content, "turns": turn, "compactions": compactions, "finish_reason": "answer"}
            else:
                messages.append({"role": "user", "content": NUDGE})
    return {"answer": notes[-1] if notes else None, "turns": max_turns, "compactions": compactions,
            "finish_reason": "max_turns"}
