"""Per-sample settings on real files: validated against the run's plugins when the source opens,
a bad row skipped (file, line and field named; counted), a reward's parameters reaching it."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.data import DataError, open_data_source, source_metrics
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.registry import Register
from miles.rewards import score_samples_blocking
from miles.sections import DataSection, RewardSection, RolloutSection
from miles_contracts import AgentSpec, RewardSpec, Sample, Status, ToolSpec
from miles_contracts.settings import SampleSettings, reward_settings
from pydantic import BaseModel, ConfigDict, Field


class WorkspaceAgentSettings(BaseModel):
    """What the test agent takes per sample."""

    model_config = ConfigDict(extra="forbid")
    repo: str
    shell: bool = False


class LengthBonus(BaseModel):
    """The test reward's per-sample parameters: a bonus for answers of at least ``min_chars``."""

    model_config = ConfigDict(extra="forbid")
    min_chars: int = Field(default=1, ge=0)
    bonus: float = 1.0


def length_bonus(samples: Sequence[Sample]) -> list[float]:
    return [p.bonus if len(s.response) >= p.min_chars else 0.0
            for s, p in ((s, reward_settings(s, LengthBonus)) for s in samples)]


async def agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> None:
    return None


class Echo:
    name = "echo"
    description = "returns its text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    async def __call__(self, text: str) -> str:
        return text


class SettingsPlugins:
    @hookimpl
    def miles_register_agents(self, register: Register[AgentSpec]) -> None:
        register("workspace_agent", AgentSpec(agent, settings_model=WorkspaceAgentSettings))
        register("plain_agent", AgentSpec(agent))

    @hookimpl
    def miles_register_rewards(self, register: Register[RewardSpec]) -> None:
        register("length_bonus", RewardSpec(length_bonus, settings_model=LengthBonus))

    @hookimpl
    def miles_register_tools(self, register: Register[ToolSpec]) -> None:
        register("echo", ToolSpec(Echo()))


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("data", "rewards"))
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(SettingsPlugins(), "settings_plugins")
    return kernel


def open_rows(kernel: Kernel, path: Path, rows: list[dict[str, Any]], *, agent: str = "workspace_agent",
              on_error: str = "skip") -> Any:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = MilesConfig(
        data=DataSection(source="jsonl", path=str(path), shuffle=False, on_error=on_error),  # type: ignore[arg-type]
        rollout=RolloutSection(generator="agentic", agent=agent),
        reward=RewardSection(name="length_bonus"),
    )
    return open_data_source(context_for(config, kernel=kernel))


GOOD = {"prompt": "fix the bug", "label": "ok", "settings": {
    "env": {"task_id": "t-1", "workspace": "repo-a", "tools": ["echo"]},
    "agent": {"repo": "https://example.invalid/a.git"},
    "reward": {"min_chars": 3, "bonus": 2.5},
    "budget": {"wall_clock_s": 30, "tokens": 4000, "max_turns": 3, "tool_timeout_s": 2, "tool_timeouts": 1},
}}


def test_a_valid_rows_settings_reach_the_sample_with_defaults_filled_in(kernel: Kernel, tmp_path: Path) -> None:
    source = open_rows(kernel, tmp_path / "train.jsonl", [GOOD, {"prompt": "plain row", "settings": {"agent": {"repo": "b"}}}])
    first, second = source.next_prompts(2)
    settings = SampleSettings.of(first)
    assert settings.env.tools == ["echo"] and settings.env.task_id == "t-1" and settings.env.workspace == "repo-a"
    assert settings.agent == {"repo": "https://example.invalid/a.git", "shell": False}  # the agent's model filled it
    assert settings.budget.tokens == 4000 and settings.budget.tool_timeouts == 1
    assert second.metadata["settings"]["reward"] == {"min_chars": 1, "bonus": 1.0}  # the reward's defaults
    assert source_metrics(source)["data/rows_invalid"] == 0.0


def test_reward_parameters_from_the_row_reach_the_reward(kernel: Kernel, tmp_path: Path) -> None:
    rows = [GOOD, {**GOOD, "settings": {**GOOD["settings"], "reward": {"min_chars": 50, "bonus": 2.5}}},
            {"prompt": "default parameters", "settings": {"agent": {"repo": "c"}}}]
    samples = open_rows(kernel, tmp_path / "train.jsonl", rows).next_prompts(3)
    for sample in samples:
        sample.response, sample.status = "four", Status.COMPLETED
    config = MilesConfig(reward=RewardSection(name="length_bonus"))
    score_samples_blocking(samples, context_for(config, kernel=kernel))
    # "four" has 4 chars: >= 3 earns the row's bonus 2.5; < 50 earns nothing; the default bonus is 1.0
    assert [s.reward for s in samples] == [2.5, 0.0, 1.0]


BAD_ROWS = [
    ({"settings": {"budget": {"tokens": 0}}}, "settings.budget.tokens: Input should be greater than or equal to 1"),
    ({"settings": {"budjet": {}}}, "settings.budjet: not a setting (expected one of env, budget, agent, reward)"),
    ({"settings": {"env": {"tools": ["echo", "calculater"]}}}, "settings.env.tools[1]: unknown tool 'calculater'"),
    ({"settings": {"agent": {"repo": 3}}}, "settings.agent.repo: Input should be a valid string"),
    ({"settings": {"agent": {}}}, "settings.agent.repo: Field required"),
    ({"settings": {"agent": {"repo": "x"}, "reward": {"bonus": "big"}}}, "settings.reward.bonus: Input should be a valid number"),
    ({"settings": {"agent": {"repo": "x"}, "reward": {"min_chars": 2}}, "metadata": {"reward": "exact_match"}},
     "settings.reward: reward 'exact_match' takes no per-sample settings (its spec has no settings_model)"),
    ({"settings": ["not", "an", "object"]}, "settings: expected an object, got list"),
    ({"metadata": {"settings": {}}}, "metadata.settings: per-sample settings go in the row's top-level 'settings' field"),
]


def test_a_row_with_bad_settings_is_skipped_named_and_counted_and_the_rest_load(kernel: Kernel, tmp_path: Path,
                                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "train.jsonl"
    rows = [GOOD, *({"prompt": f"bad {i}", **row} for i, (row, _) in enumerate(BAD_ROWS)), GOOD]
    with caplog.at_level(logging.WARNING):
        source = open_rows(kernel, path, rows)
    assert len(source) == 2  # the run goes on with the good rows
    metrics = source_metrics(source)
    assert metrics["data/rows_invalid"] == len(BAD_ROWS) == metrics["data/skipped_records"]
    for line, (_, message) in enumerate(BAD_ROWS, start=2):
        assert f"{path}:{line}: {message}" in caplog.text


def test_settings_a_plugin_cannot_take_are_refused_not_ignored(kernel: Kernel, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "a", "settings": {"agent": {"repo": "x"}}}, {"prompt": "b"}]
    source = open_rows(kernel, path, rows, agent="plain_agent")
    assert len(source) == 1 and source_metrics(source)["data/rows_invalid"] == 1.0
    with pytest.raises(DataError, match=rf"{path}:1: settings.agent: agent 'plain_agent' takes no per-sample settings"):
        open_rows(kernel, path, rows, agent="plain_agent", on_error="fail")


def test_without_a_settings_model_a_row_without_settings_stays_as_it_was(kernel: Kernel, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n')
    config = MilesConfig(data=DataSection(source="jsonl", path=str(path)))  # exact_match, no agent: no models
    (sample,) = open_data_source(context_for(config, kernel=kernel)).next_prompts(1)
    assert "settings" not in sample.metadata and SampleSettings.of(sample) == SampleSettings()
