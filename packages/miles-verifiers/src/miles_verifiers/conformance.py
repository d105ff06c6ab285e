"""The verifiers rows of ``miles bench conformance``: the two demo environments driven through the
adapter's own agent (its data rows, its rollout, its rubric), as a run would drive them."""

from __future__ import annotations

from typing import Any

from miles_tito.conformance.rows import Episode, Row
from miles_tito.conformance.script import ToolScript

from miles_verifiers.agent import VerifiersAgent
from miles_verifiers.loading import load_environment
from miles_verifiers.section import VerifiersSection
from miles_verifiers.source import VerifiersDataSource

ADD = ToolScript("add", {"a": 2, "b": 3})
# no tool offered: the turns are answers, and now and then an unreadable call
ANSWERS = ToolScript("add", {}, calls=0, malformed=1, period=3)


def _row(harness: str, environment: str, script: ToolScript, args: dict[str, Any]) -> Row:
    async def run(episode: Episode) -> dict[str, Any]:
        section = VerifiersSection(environment=environment, args=args)
        source = VerifiersDataSource([dict(r) for r in load_environment(section).get_dataset()])
        source.position = episode.index
        [sample] = source.next_prompts(1)
        metadata = {**sample.metadata, "api_key": episode.api_key}
        return await VerifiersAgent(section)(episode.base_url, sample.prompt, {"max_tokens": episode.max_tokens}, metadata)

    return Row(harness, "chat", run, script)


def rows() -> list[Row]:
    return [
        _row("verifiers SingleTurnEnv", "miles_verifiers.demo_envs.sum_single_turn", ANSWERS, {}),
        _row("verifiers ToolEnv", "miles_verifiers.demo_envs.adder_tools", ADD, {"max_turns": 4}),
    ]
