"""Plugin ``solver-verifier``: registers the episode's program as the agent ``solver_verifier``
(``rollout.agent``) and its reward as ``solver_verifier`` (``reward.name``)."""

from __future__ import annotations

from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec, RewardSpec


async def _run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any] | None:
    from solver_verifier.agent import run_agent  # the openai client loads when an agent runs

    return await run_agent(base_url, prompt, request_kwargs, metadata)


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("solver_verifier", AgentSpec(_run_agent))


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    from solver_verifier.reward import solver_verifier

    register("solver_verifier", RewardSpec(solver_verifier))
