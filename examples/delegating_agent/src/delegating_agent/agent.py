"""The agents: a main agent on OpenAI chat completions and a sub-agent on Anthropic's Messages API.

1. The main agent asks the model how to go about the task (its first turn).
2. It opens a sub-agent's session in its own episode: ``POST {base_url}/children`` with its own
   session key, role ``subagent``. The answer is another session (``base_url``, ``api_key``).
3. The sub-agent, an ``anthropic.AsyncAnthropic`` client on that session, solves the task in two
   turns (an attempt, then a check of it).
4. The main agent gets the sub-agent's answer as a user message and gives the final answer.

Both sessions record the exact tokens of their turns; the episode has two branches: the main
agent's (role ``agent``, the primary: its last turn is the episode's answer) and the sub-agent's
(role ``subagent``, cause ``subagent``), each trained on its own turns only.
"""

from __future__ import annotations

from typing import Any, cast

import httpx
from anthropic import AsyncAnthropic
from anthropic.types import MessageParam
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessageParam

MAIN_SYSTEM = "You coordinate a helper. Plan briefly, then give the final answer as 'Answer: <number>'."
SUBAGENT_SYSTEM = "You are a careful arithmetic helper. Work the problem out and reply with the number."
CHECK_REQUEST = "Check your work once more and reply with the final number only."


async def open_child(base_url: str, api_key: str, role: str, parent_turn: int | None = None) -> dict[str, Any]:
    """A session for another agent in this session's episode (``POST {base_url}/children``): its
    ``session_id``, ``base_url``, ``api_key`` and ``episode_id``. The session key is enough."""
    body: dict[str, Any] = {"role": role}
    if parent_turn is not None:
        body["parent_turn"] = parent_turn
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        answer = await http.post(f"{base_url}/children", json=body, headers={"Authorization": f"Bearer {api_key}"})
        answer.raise_for_status()
        return cast(dict[str, Any], answer.json())


def messages_kwargs(request_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The run's sampling settings (OpenAI names) as ``messages.create`` arguments. The Anthropic SDK
    (2.x) has no sampling arguments besides ``max_tokens`` and ``stop_sequences`` any more: the
    others travel in ``extra_body``, which the session server reads like the rest of the body."""
    kwargs: dict[str, Any] = {"max_tokens": request_kwargs.get("max_tokens", 256)}
    if request_kwargs.get("stop"):
        stop = request_kwargs["stop"]
        kwargs["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    extra = {name: request_kwargs[name] for name in ("temperature", "top_p") if name in request_kwargs}
    extra.update(request_kwargs.get("extra_body") or {})  # top_k
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


async def run_subagent(child: dict[str, Any], task: str, request_kwargs: dict[str, Any]) -> str:
    """Two Messages API turns in the child's session; the text of the last."""
    # Anthropic's SDK appends /v1/messages itself; the session's key goes in x-api-key
    client = AsyncAnthropic(base_url=child["base_url"].removesuffix("/v1"), api_key=child["api_key"], max_retries=0)
    messages: list[MessageParam] = [{"role": "user", "content": task}]
    text = ""
    async with client:
        for follow_up in (CHECK_REQUEST, None):
            reply = await client.messages.create(model="policy", system=SUBAGENT_SYSTEM, messages=messages,
                                                 **messages_kwargs(request_kwargs))
            text = "".join(block.text for block in reply.content if block.type == "text")
            # the reply as returned (all its blocks), so the server recognises its own turn
            messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
    return text


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict``; ``metadata["api_key"]``
    is the main session's key."""
    task = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": task}]
    async with AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client:
        plan = (await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)).choices[0].message
        messages.append(cast(ChatCompletionAssistantMessageParam, plan.model_dump(exclude_none=True)))
        child = await open_child(base_url, metadata["api_key"], "subagent")  # spawned at the plan's turn
        helper = await run_subagent(child, task, request_kwargs)
        messages.append({"role": "user", "content": f"Your helper answered: {helper!r}. Now give the final answer."})
        final = (await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)).choices[0].message
    return {"answer": final.content, "plan": plan.content, "subagent_answer": helper, "subagent_session": child["session_id"]}
