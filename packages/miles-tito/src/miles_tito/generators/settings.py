"""What the ``multi_turn`` and ``agentic`` generators read from their :class:`GenerateContext`.

``ctx.resources`` keys (all optional; the rollout manager fills them, tests may too):

* ``"kernel"``: the run's :class:`Kernel` (registries of tools, agents, families);
* ``"config"``: the run's :class:`MilesConfig` -- ``rollout.tools``, ``rollout.agent``,
  ``rollout.agent_timeout``, ``rollout.max_turns`` and the ``tito`` section are read from it;
* ``"chat_family"``: a :class:`ChatFamily` or its registered name (else ``tito.family``, else the
  family the model's bridge names, inferred from the tokenizer's folder);
* ``"tools"``: ``{name: Tool}`` overriding ``rollout.tools``;
* ``"agent"``: an agent callable or registered name overriding ``rollout.agent``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.errors import MilesError
from miles.kernel import Kernel
from miles.sections import RolloutSection
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
    resources = ctx.resources
    config = resources.get("config")
    rollout: RolloutSection = config.rollout if config is not None else RolloutSection()
    tito: TitoSection = config.section("tito", TitoSection) if config is not None else TitoSection()
    kernel = resources.get("kernel") or (Kernel.load(config.plugin_selection) if config is not None else Kernel.load())

    family = resources.get("chat_family") or tito.family
    if not isinstance(family, ChatFamily):
        family = kernel.chat_families().get(family) if family else family_of_tokenizer(ctx.tokenizer)

    tools: Mapping[str, Tool] | None = resources.get("tools")
    if tools is None:
        tools = {name: kernel.tools().get(name) for name in rollout.tools}

    agent = resources.get("agent") or rollout.agent
    if isinstance(agent, str):
        agent = kernel.agents().get(agent)
    if need_agent and agent is None:
        raise MilesError("the agentic generator needs an agent: set rollout.agent to a registered agent's name")
    return GeneratorSettings(family, dict(tools), agent, rollout.agent_timeout, rollout.max_turns, tito)


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sample's prompt as OpenAI messages: a string is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
