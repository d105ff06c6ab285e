"""Per-sample settings: what one data row may set for its own episode.

A row of a prompt file may carry a ``settings`` object next to its prompt and label::

    {"prompt": "...", "label": "42",
     "settings": {"env": {"task_id": "t-17", "workspace": "repo-a", "tools": ["calculator"]},
                  "agent": {...}, "reward": {...},
                  "budget": {"wall_clock_s": 120, "tokens": 20000, "max_turns": 12,
                             "tool_timeout_s": 10, "tool_timeouts": 2}}}

``env`` and ``budget`` are typed here (every generator reads them); ``agent`` and ``reward`` are
validated by the settings model of the run's agent (:attr:`AgentSpec.settings_model`) and of the
row's reward (:attr:`RewardSpec.settings_model`). The data source validates every row when it opens
(a row that fails is skipped and counted, its file, line and field named) and stores the validated
settings, defaults filled in, in ``sample.metadata["settings"]``: generators read them with
:meth:`SampleSettings.of`, a reward reads its parameters with :func:`reward_settings`.
See ``docs/design/debugging.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from miles_contracts.sample import Sample

SETTINGS_KEY = "settings"
"""The row's field and the ``sample.metadata`` key that hold a sample's settings."""

M = TypeVar("M", bound=BaseModel)


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvSettings(_Settings):
    """The environment of one episode.

    :ivar task_id: the task's own id (shown in logs and dumps; handed to the agent).
    :ivar workspace: the workspace template the agent (or its sandbox) prepares the episode from.
    :ivar tools: registered tools offered in this episode, replacing ``rollout.tools``.
    """

    task_id: str | None = Field(default=None, max_length=256)
    workspace: str | None = Field(default=None, max_length=4096)
    tools: list[str] | None = Field(default=None, max_length=256)


class Budget(_Settings):
    """Limits of one episode; each one left out is the run's (see ``docs/design/debugging.md``).

    :ivar wall_clock_s: seconds the episode may take (default ``rollout.agent_timeout`` for an
        agent; no limit for ``multi_turn``); over it: exit reason ``wall_clock_budget``.
    :ivar tokens: tokens the episode's turns may add (prompt increments and sampled ids); at most
        ``tito.max_tokens_per_episode``; over it: ``token_budget``.
    :ivar max_turns: model turns (default ``rollout.max_turns``).
    :ivar tool_timeout_s: seconds one tool call may take (default ``tito.tool_timeout``).
    :ivar tool_timeouts: tool calls that may time out before the episode ends (default
        ``tito.tool_timeout_budget``); a tolerated one answers the model with an error text.
    """

    wall_clock_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tokens: int | None = Field(default=None, ge=1)
    max_turns: int | None = Field(default=None, ge=1)
    tool_timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tool_timeouts: int | None = Field(default=None, ge=0)


class SampleSettings(_Settings):
    """A row's ``settings`` (see the module docstring)."""

    env: EnvSettings = Field(default_factory=EnvSettings)
    budget: Budget = Field(default_factory=Budget)
    agent: dict[str, Any] = Field(default_factory=dict)
    reward: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, sample: Sample) -> SampleSettings:
        """The sample's settings (validated when its row was read); empty ones for a sample without."""
        return cls.model_validate(sample.metadata.get(SETTINGS_KEY) or {})


def reward_settings(sample: Sample, model: type[M]) -> M:
    """A reward's parameters for ``sample``: its row's ``settings.reward`` read by ``model`` (the
    reward's :attr:`RewardSpec.settings_model`); the model's defaults for a sample without."""
    return model.model_validate((sample.metadata.get(SETTINGS_KEY) or {}).get("reward") or {})


__all__ = ["SETTINGS_KEY", "Budget", "EnvSettings", "SampleSettings", "reward_settings"]
