"""Plugin ``openenv`` (distribution miles-openenv): an OpenEnv environment server as the ``openenv``
data source, agent and reward, with the ``openenv`` config section naming the server.

Light on purpose: ``miles plugins`` imports this module; openenv-core and the OpenAI client load
only when a run uses them (in the driver, where the data source, the agent and the reward run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec, ConfigSectionSpec, DataSourceSpec, RewardSpec, RunContext, Sample

from miles_openenv.section import OpenEnvSection


def _open_source(ctx: RunContext, data: Any) -> Any:
    from miles_openenv.agent import OpenEnvDataSource

    return OpenEnvDataSource.open(ctx, data)


async def _unbound_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
    raise RuntimeError("the openenv agent runs bound to a run's openenv section (AgentSpec.bind)")


def _bind_agent(ctx: RunContext) -> Any:
    from miles_openenv.agent import bind_agent

    return bind_agent(ctx)


def _reward(samples: Sequence[Sample]) -> list[float]:
    from miles_openenv.agent import episode_reward

    return episode_reward(samples)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("openenv", ConfigSectionSpec(OpenEnvSection))


@hookimpl
def miles_register_data_sources(register: Register[DataSourceSpec]) -> None:
    register("openenv", DataSourceSpec(_open_source))


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("openenv", AgentSpec(_unbound_agent, bind=_bind_agent))


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("openenv", RewardSpec(_reward))
