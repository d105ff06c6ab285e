"""Running the model's tool calls for the ``multi_turn`` generator.

Who is at fault decides what happens:

* the *model's* mistakes -- an unknown tool, arguments the tool does not accept -- become an error
  text in the tool message, so the model sees it and the trajectory goes on (the model can learn
  from it);
* a *tool* that raises is a broken environment, not a model mistake: the sample ends ABORTED with
  exit reason ``tool_error`` (training on it would punish the model for the tool). Tools report
  expected failures (division by zero, no search results) by returning text;
* a tool call that times out is tolerated while the episode's timeout budget lasts
  (``tito.tool_timeout_budget`` or the row's ``settings.budget.tool_timeouts``): the model gets an
  error text saying the call timed out and may try again; one timeout more ends the sample ABORTED
  with exit reason ``tool_timeout_budget``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_contracts import Tool
from miles_contracts.chat import ToolCall

from miles_tito.messages import ChatMessage


class ToolFailure(Exception):
    """A tool raised (the environment failed, not the model)."""


class ToolTimeoutBudgetSpent(ToolFailure):
    """A tool call timed out and the episode had no tolerated timeout left."""


@dataclass(slots=True)
class ToolTimeouts:
    """One episode's tool-call timeouts: each call may take ``seconds``; ``tolerated`` may time out."""

    seconds: float
    tolerated: int
    spent: int = 0


def tool_specs(tools: Mapping[str, Tool]) -> list[dict[str, Any]] | None:
    """OpenAI tool specs of ``tools`` (None when there are none)."""
    if not tools:
        return None
    return [
        {"type": "function", "function": {"name": name, "description": tool.description, "parameters": tool.parameters}}
        for name, tool in tools.items()
    ]


async def run_tool_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool], timeouts: ToolTimeouts) -> list[ChatMessage]:
    """One tool message per call, in call order. Raises :class:`ToolFailure`
    (:class:`ToolTimeoutBudgetSpent` for a timeout over the budget)."""
    return [
        ChatMessage(role="tool", content=await _run_one(call, tools, timeouts), tool_call_id=call.id, name=call.name)
        for call in calls
    ]


async def _run_one(call: ToolCall, tools: Mapping[str, Tool], timeouts: ToolTimeouts) -> str:
    tool = tools.get(call.name)
    if tool is None:
        return f"error: there is no tool named {call.name!r}; available tools: {', '.join(sorted(tools)) or 'none'}"
    arguments = json.loads(call.arguments)  # parsers only produce JSON objects
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as exc:
        return f"error: wrong arguments for {call.name}: {exc}"
    try:
        result = await asyncio.wait_for(tool(**arguments), timeout=timeouts.seconds)
    except TimeoutError:
        timeouts.spent += 1
        what = f"tool {call.name!r} did not answer within {timeouts.seconds:g}s"
        if timeouts.spent > timeouts.tolerated:
            raise ToolTimeoutBudgetSpent(f"{what}: {timeouts.spent} tool timeouts, {timeouts.tolerated} tolerated") from None
        return f"error: {what} (timeout {timeouts.spent} of {timeouts.tolerated} tolerated); try again or another way"
    except Exception as exc:
        raise ToolFailure(f"tool {call.name!r} raised {type(exc).__name__}: {exc}") from exc
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
