"""Plugin ``compacting-agent``: registers the agent as ``compacting_agent`` (``rollout.agent``)."""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec


async def _run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any] | None:
    from compacting_agent.agent import run_agent  # the openai client loads when an agent runs

    return await run_agent(base_url, prompt, request_kwargs, metadata)


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("compacting_agent", AgentSpec(_run_agent))
