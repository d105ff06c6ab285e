"""What the ``multi_turn`` and ``agentic`` generators read from their :class:`GenerateContext`.

Everything comes from ``ctx.run``, the driver's run context: its config (``rollout.tools``,
``rollout.agent``, ``rollout.agent_timeout``, ``rollout.max_turns`` and the ``tito`` section) and
its kernel, loaded for the run's plugin selection, whose registries the names resolve in (tools,
agents, chat families). The chat family is ``tito.family``, else the one the model's bridge names
(inferred from the tokenizer's folder). A test that wants a tool, an agent or a family of its own
registers it in a kernel of its own (``kernel.register_plugin``) and names it in the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles.errors import MilesError
from miles_contracts import AgentFn, GenerateContext, Tool
from miles_contracts.chat import ChatFamily

from miles_tito.config import TitoSection
from miles_tito.families import family_of_tokenizer


@dataclass(slots=True)
class GeneratorSettings:
    family: ChatFamily
    tools: dict[str, Tool] = field(default_factory=dict)
    agent: AgentFn | None = None
    agent_timeout: float = 300.0
    max_turns: int = 8
    tito: TitoSection = field(default_factory=TitoSection)


def settings_from(ctx: GenerateContext, *, need_agent: bool = False) -> GeneratorSettings:
    """The settings of one generate call, from the run's config and kernel (``ctx.run``)."""
    config, kernel = ctx.run.config, ctx.run.kernel
    rollout = config.rollout
    tito = config.section("tito", TitoSection)
    family = kernel.chat_families().get(tito.family) if tito.family else family_of_tokenizer(ctx.tokenizer, kernel=kernel)
    tools = {name: kernel.tools().get(name).tool for name in rollout.tools}
    spec = kernel.agents().get(rollout.agent) if rollout.agent else None
    agent = None if spec is None else spec.bind(ctx.run) if spec.bind is not None else spec.run
    if need_agent and agent is None:
        raise MilesError("the agentic generator needs an agent: set rollout.agent to a registered agent's name")
    return GeneratorSettings(family, tools, agent, rollout.agent_timeout, rollout.max_turns, tito)


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sample's prompt as OpenAI messages: a string is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
