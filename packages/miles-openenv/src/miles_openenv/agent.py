"""The ``openenv`` agent, data source and reward: an OpenEnv environment server played by the
policy through the session server.

Per episode: open a WebSocket session on the environment (openenv-core's ``GenericEnvClient``),
``reset(seed)``, then until the environment says ``done`` (or ``max_steps``): show the observation
as a user message, ask the model (the official ``openai`` client on the Miles session), send its
reply as the action's text field to ``step``. The step rewards summed are the episode's reward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from miles_contracts import AgentFn, RunContext, Sample

from miles_openenv.section import OpenEnvSection


class OpenEnvConfigError(ValueError):
    """The ``openenv`` section cannot drive an environment."""


class OpenEnvAgent:
    """``run_agent(base_url, prompt, request_kwargs, metadata)`` for one run's environment server."""

    def __init__(self, section: OpenEnvSection) -> None:
        if not section.url:
            raise OpenEnvConfigError("openenv.url is empty: set it to the environment server, e.g. "
                                     "openenv.url=http://127.0.0.1:8000 (python -m miles_openenv.guess_number serves one)")
        self.section = section

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        from openai import AsyncOpenAI
        from openenv import GenericEnvClient

        section = self.section
        messages: list[Any] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        episode = metadata.get("openenv")
        episode = episode if isinstance(episode, dict) else {}
        seed = episode.get("seed", metadata.get("group_index"))
        rewards: list[float] = []
        async with (GenericEnvClient(base_url=section.url, message_timeout_s=section.message_timeout_s) as env,
                    AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client):
            result = await env.reset(**section.reset_args, seed=seed)
            while not result.done and len(rewards) < section.max_steps:
                messages.append({"role": "user", "content": self.observation_text(result.observation)})
                reply = await client.chat.completions.create(model=section.model, messages=messages, **request_kwargs)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))  # the turn as returned
                result = await env.step({section.action_field: message.content or ""})
                rewards.append(float(result.reward or 0.0))
        return {"reward": sum(rewards), "step_rewards": rewards, "steps": len(rewards), "done": bool(result.done)}

    def observation_text(self, observation: Mapping[str, Any]) -> str:
        field = self.section.observation_field
        if field is not None:
            if field not in observation:
                raise OpenEnvConfigError(f"the observation has no field {field!r} (openenv.observation_field); "
                                         f"it has {sorted(observation)}")
            return str(observation[field])
        shown = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        return json.dumps(shown, ensure_ascii=False)


def bind_agent(ctx: RunContext) -> AgentFn:
    return OpenEnvAgent(ctx.config.section("openenv", OpenEnvSection))


class OpenEnvDataSource:
    """A :class:`miles_contracts.DataSource` of episodes: each prompt is the section's system
    prompt and a seed (``metadata["openenv"]["seed"]``, the prompt's position), so a group's
    samples play the same episode (GRPO compares them)."""

    def __init__(self, section: OpenEnvSection, first_seed: int = 0) -> None:
        self.section = section
        self.position = first_seed

    @classmethod
    def open(cls, ctx: RunContext, data: Any) -> OpenEnvDataSource:
        # held-out episodes: seeds far from the training ones
        return cls(ctx.config.section("openenv", OpenEnvSection), first_seed=1_000_000 if data.eval_path else 0)

    def next_prompts(self, n: int) -> list[Sample]:
        prompt = [{"role": "system", "content": self.section.system_prompt}] if self.section.system_prompt else []
        samples = [Sample(prompt=list(prompt), metadata={"openenv": {"seed": self.position + i}}) for i in range(n)]
        self.position += n
        return samples

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


def episode_reward(samples: Sequence[Sample]) -> list[float]:
    """The ``openenv`` reward: the episode's step rewards summed (NaN when it did not finish)."""
    rewards = []
    for sample in samples:
        result = sample.metadata.get("agent_result")
        reward = result.get("reward") if isinstance(result, dict) else None
        rewards.append(float(reward) if isinstance(reward, int | float) else math.nan)
    return rewards
