"""Plugin ``delegating-agent``: registers the agent as ``delegating_agent`` (``rollout.agent``)."""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec


async def _run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any] | None:
    from delegating_agent.agent import run_agent  # the openai and anthropic clients load when an agent runs

    return await run_agent(base_url, prompt, request_kwargs, metadata)


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("delegating_agent", AgentSpec(_run_agent))
