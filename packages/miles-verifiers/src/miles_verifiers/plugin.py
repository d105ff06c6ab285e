"""Plugin ``verifiers`` (distribution miles-verifiers): a verifiers environment as the ``verifiers``
data source, agent and reward, with the ``verifiers`` config section naming the environment.

Light on purpose: ``miles plugins`` imports this module; verifiers and the OpenAI client load only
when a run uses them (in the driver, where the data source, the agent and the reward run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec, ConfigSectionSpec, DataSourceSpec, RewardSpec, RunContext, Sample

from miles_verifiers.section import VerifiersSection


def _open_source(ctx: RunContext, data: Any) -> Any:
    from miles_verifiers.source import VerifiersDataSource

    return VerifiersDataSource.open(ctx, data)


async def _unbound_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
    raise RuntimeError("the verifiers agent runs bound to a run's verifiers section (AgentSpec.bind)")


def _bind_agent(ctx: RunContext) -> Any:
    from miles_verifiers.agent import bind_agent

    return bind_agent(ctx)


def _reward(samples: Sequence[Sample]) -> list[float]:
    from miles_verifiers.agent import rubric_reward

    return rubric_reward(samples)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("verifiers", ConfigSectionSpec(VerifiersSection))


@hookimpl
def miles_register_data_sources(register: Register[DataSourceSpec]) -> None:
    register("verifiers", DataSourceSpec(_open_source))


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("verifiers", AgentSpec(_unbound_agent, bind=_bind_agent))


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("verifiers", RewardSpec(_reward))
