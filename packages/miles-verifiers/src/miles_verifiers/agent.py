"""The ``verifiers`` agent and reward: a verifiers environment's own rollout, its model calls going
through the session server, scored by the environment's rubric.

The environment drives the episode exactly as under ``vf-eval`` (its ``rollout``: prompt, model
turn, ``env_response``, stop conditions, tools); the only change is its client, an ``AsyncOpenAI``
pointed at the Miles session (``base_url``, the session's key), so the session server records
every turn token-exact. The rubric then scores the finished state; the ``verifiers`` reward hands
that score to Miles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from miles_contracts import AgentFn, RunContext, Sample

from miles_verifiers.loading import load_environment
from miles_verifiers.section import VerifiersSection


class VerifiersRolloutError(RuntimeError):
    """The environment's rollout ended with an error (the sample is aborted with it)."""


class VerifiersAgent:
    """``run_agent(base_url, prompt, request_kwargs, metadata)`` for one run's environment."""

    def __init__(self, section: VerifiersSection) -> None:
        self.section = section

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        from openai import AsyncOpenAI
        from verifiers.legacy.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

        env = load_environment(self.section)
        row = metadata.get("verifiers")
        if not isinstance(row, dict):
            raise VerifiersRolloutError(
                "the sample has no metadata['verifiers'] row: use data.source=verifiers with the verifiers agent"
            )
        rollout_input = {"example_id": 0, **row, "prompt": prompt}
        # max_retries=0: a failed turn is the session's to report, not something to hide by resending
        async with AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as openai:
            client = OpenAIChatCompletionsClient(openai)
            state = await env.rollout(rollout_input, client, self.section.model, dict(request_kwargs))
            if state.get("error") is not None:
                raise VerifiersRolloutError(f"the verifiers rollout failed: {state['error']!r}")
            await env.rubric.score_rollout(state)
        return {
            "reward": float(state["reward"]) if state.get("reward") is not None else None,
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
            "turns": len(state.get("trajectory") or []),
            "stop_condition": state.get("stop_condition"),
            "truncated": bool(state.get("is_truncated")),
        }


def bind_agent(ctx: RunContext) -> AgentFn:
    """The agent of this run (its ``verifiers`` section), loading the environment up front so a
    bad environment id fails the run at start, not every sample."""
    section = ctx.config.section("verifiers", VerifiersSection)
    load_environment(section)
    return VerifiersAgent(section)


def rubric_reward(samples: Sequence[Sample]) -> list[float]:
    """The ``verifiers`` reward: the rubric's score of each sample's rollout (NaN when the rollout
    did not finish, so it was never scored)."""
    rewards = []
    for sample in samples:
        result = sample.metadata.get("agent_result")
        reward = result.get("reward") if isinstance(result, dict) else None
        rewards.append(float(reward) if isinstance(reward, int | float) else math.nan)
    return rewards
