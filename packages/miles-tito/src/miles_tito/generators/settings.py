"""What the ``multi_turn`` and ``agentic`` generators read from their :class:`GenerateContext` and
the sample's own settings.

Everything comes from ``ctx.run``, the driver's run context: its config (``rollout.tools``,
``rollout.agent``, ``rollout.agent_timeout``, ``rollout.max_turns`` and the ``tito`` section) and
its kernel, loaded for the run's plugin selection, whose registries the names resolve in (tools,
agents, chat families); a sample's row may replace the tools and the limits for its own episode
(``settings.env.tools``, ``settings.budget``: :mod:`miles_contracts.settings`). The chat family is ``tito.family``, else the one the model's bridge names
(inferred from the tokenizer's folder). A test that wants a tool, an agent or a family of its own
registers it in a kernel of its own (``kernel.register_plugin``) and names it in the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from miles.errors import MilesError
from miles_contracts import AgentFn, GenerateContext, Sample, Tool
from miles_contracts.chat import ChatFamily
from miles_contracts.settings import SampleSettings

from miles_tito.config import TitoSection
from miles_tito.families import family_of_tokenizer


@dataclass(frozen=True, slots=True)
class Limits:
    """One episode's limits: its row's ``settings.budget``, else the run's.

    :ivar wall_clock_s: seconds the episode may take (None: no limit).
    :ivar tokens: tokens its turns may add; a row may only lower ``tito.max_tokens_per_episode``.
    :ivar tokens_from: the setting ``tokens`` comes from (named in the ending's detail).
    :ivar max_turns: model turns.
    :ivar tool_timeout_s: seconds one tool call may take.
    :ivar tool_timeouts: tool calls that may time out before the episode ends.
    """

    wall_clock_s: float | None
    tokens: int
    tokens_from: str
    max_turns: int
    tool_timeout_s: float
    tool_timeouts: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class GeneratorSettings:
    family: ChatFamily
    limits: Limits
    tools: dict[str, Tool] = field(default_factory=dict)
    agent: AgentFn | None = None
    tito: TitoSection = field(default_factory=TitoSection)


def settings_from(ctx: GenerateContext, sample: Sample, *, need_agent: bool = False) -> GeneratorSettings:
    """The settings of one generate call, from the run's config and kernel (``ctx.run``) and the
    sample's settings (validated when its row was read)."""
    config, kernel = ctx.run.config, ctx.run.kernel
    rollout = config.rollout
    tito = config.section("tito", TitoSection)
    row = SampleSettings.of(sample)
    family = kernel.chat_families().get(tito.family) if tito.family else family_of_tokenizer(ctx.tokenizer, kernel=kernel)
    tool_names = rollout.tools if row.env.tools is None else row.env.tools
    tools = {name: kernel.tools().get(name).tool for name in tool_names}
    spec = kernel.agents().get(rollout.agent) if rollout.agent else None
    agent = None if spec is None else spec.bind(ctx.run) if spec.bind is not None else spec.run
    if need_agent and agent is None:
        raise MilesError("the agentic generator needs an agent: set rollout.agent to a registered agent's name")
    return GeneratorSettings(family, limits_of(row, rollout.agent_timeout if need_agent else None, rollout.max_turns, tito),
                             tools, agent, tito)


def limits_of(row: SampleSettings, wall_clock_s: float | None, max_turns: int, tito: TitoSection) -> Limits:
    """The episode's limits: each one the row's budget sets, else the run's."""
    budget = row.budget
    row_tokens = budget.tokens is not None and budget.tokens < tito.max_tokens_per_episode
    return Limits(
        wall_clock_s=budget.wall_clock_s if budget.wall_clock_s is not None else wall_clock_s,
        tokens=budget.tokens if budget.tokens is not None and row_tokens else tito.max_tokens_per_episode,
        tokens_from="the row's settings.budget.tokens" if row_tokens else "tito.max_tokens_per_episode",
        max_turns=budget.max_turns if budget.max_turns is not None else max_turns,
        tool_timeout_s=budget.tool_timeout_s if budget.tool_timeout_s is not None else tito.tool_timeout,
        tool_timeouts=budget.tool_timeouts if budget.tool_timeouts is not None else tito.tool_timeout_budget,
    )


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A sample's prompt as OpenAI messages: a string is one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]
