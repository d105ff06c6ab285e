"""The OpenEnv adapter's parts without a model: the guess_number environment served by openenv-core
on loopback and played with openenv-core's own client, the data source's seeds, the reward and the
section's errors."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from miles_contracts import Sample
from miles_openenv.agent import OpenEnvAgent, OpenEnvConfigError, OpenEnvDataSource, episode_reward
from miles_openenv.guess_number import MAX_GUESSES, create_guess_number_app
from miles_openenv.section import OpenEnvSection
from miles_tito.server.background import BackgroundServer


def test_the_environment_server_speaks_reset_and_step() -> None:
    from openenv import GenericEnvClient

    async def play(url: str) -> list[Any]:
        async with GenericEnvClient(base_url=url) as env:
            results = [await env.reset(seed=5)]
            for guess in range(1, MAX_GUESSES + 1):
                results.append(await env.step({"message": f"is it {guess}?"}))
                if results[-1].done:
                    break
            return results

    with BackgroundServer(create_guess_number_app) as server:
        results = asyncio.run(play(server.url))
    assert "Guess it" in results[0].observation["prompt"] and not results[0].done
    assert results[-1].done and [r.observation["guesses"] for r in results[1:]] == list(range(1, len(results)))
    assert all(r.observation["prompt"] in ("Higher.", "Lower.", "Correct!") for r in results[1:])


def test_a_group_plays_one_episode_and_seeds_move_on() -> None:
    source = OpenEnvDataSource(OpenEnvSection(url="http://x", system_prompt="Play."))
    first, second = source.next_prompts(2)
    assert first.prompt == [{"role": "system", "content": "Play."}]
    assert (first.metadata["openenv"]["seed"], second.metadata["openenv"]["seed"]) == (0, 1)
    source.load_state_dict({"position": 7})
    assert source.next_prompts(1)[0].metadata["openenv"]["seed"] == 7


def test_reward_and_section_errors() -> None:
    assert episode_reward([Sample(metadata={"agent_result": {"reward": 1.0}})]) == [1.0]
    assert math.isnan(episode_reward([Sample()])[0])
    with pytest.raises(OpenEnvConfigError, match="openenv.url"):
        OpenEnvAgent(OpenEnvSection())
    agent = OpenEnvAgent(OpenEnvSection(url="http://x", observation_field="text"))
    with pytest.raises(OpenEnvConfigError, match="has no field 'text'"):
        agent.observation_text({"prompt": "hi"})
    assert OpenEnvAgent(OpenEnvSection(url="http://x")).observation_text({"prompt": "hi", "done": False}) == '{"prompt": "hi"}'
