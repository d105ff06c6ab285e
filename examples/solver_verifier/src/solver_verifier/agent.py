"""The episode: a solver and a verifier, both the policy being trained, each in its own session.

* The **solver** is the episode's first session (the one the ``agentic`` generator opens, with the
  role ``tito.agent_role`` of the config: ``solver``, :data:`~solver_verifier.roles.SOLVER_ROLE`). It answers the task in one turn.
* The **verifier** is a session the solver's program opens in the same episode with
  ``POST {base_url}/children`` (role ``verifier``, spawned at the solver's answer). It is asked
  whether the solver's answer is right and replies yes or no.

The program returns ``{"answer": ..., "verdict": "yes" | "no", ...}``; the generator keeps it in
``sample.metadata["agent_result"]``, where the reward (:mod:`solver_verifier.reward`) reads it.
"""

from __future__ import annotations

import re
from typing import Any, cast

import httpx
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from solver_verifier.roles import VERIFIER_ROLE

SOLVER_SYSTEM = "Solve the problem. Reply with 'Answer: <number>'."
VERIFIER_SYSTEM = "You check other people's answers. Reply 'yes' if the proposed answer is correct, else 'no'."
_YES = re.compile(r"^\W*yes\b", re.IGNORECASE)


def verdict_of(reply: str) -> str:
    """``yes`` when the verifier's reply starts with yes; anything else is a ``no``."""
    return "yes" if _YES.match(reply) else "no"


async def open_child(base_url: str, api_key: str, role: str) -> dict[str, Any]:
    """A session of another role in this session's episode, spawned at its last turn."""
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        answer = await http.post(f"{base_url}/children", json={"role": role},
                                 headers={"Authorization": f"Bearer {api_key}"})
        answer.raise_for_status()
        return cast(dict[str, Any], answer.json())


async def ask(base_url: str, api_key: str, messages: list[ChatCompletionMessageParam], request_kwargs: dict[str, Any]) -> str:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        response = await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)
    return response.choices[0].message.content or ""


async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict``; ``metadata["api_key"]``
    is the solver session's key."""
    task = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    answer = await ask(base_url, metadata["api_key"],
                       [{"role": "system", "content": SOLVER_SYSTEM}, {"role": "user", "content": task}], request_kwargs)
    verifier = await open_child(base_url, metadata["api_key"], VERIFIER_ROLE)
    question = f"Problem: {task}\nProposed answer: {answer}\nIs the proposed answer correct? Reply yes or no."
    reply = await ask(verifier["base_url"], verifier["api_key"],
                      [{"role": "system", "content": VERIFIER_SYSTEM}, {"role": "user", "content": question}], request_kwargs)
    return {"answer": answer, "verdict": verdict_of(reply), "verifier_reply": reply, "verifier_session": verifier["session_id"]}
