"""The ``openenv`` config section: which OpenEnv environment server a run plays, and how its text
actions and observations map onto chat messages."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class OpenEnvSection(BaseModel):
    """``openenv:`` in a run's config.

    :ivar url: the environment server (``http://host:port``; its ``/ws`` sessions are used, one
        per episode). Needed by the ``openenv`` agent.
    :ivar action_field: the action's text field the model's reply fills (``{action_field: reply}``).
    :ivar observation_field: the observation's field shown to the model as the next user message;
        None: the whole observation as JSON (``done``, ``reward`` and ``metadata`` left out).
    :ivar system_prompt: the episode's system message (the ``openenv`` data source's prompt).
    :ivar max_steps: most environment steps (model turns) per episode.
    :ivar reset_args: keyword arguments of every ``reset`` besides ``seed``.
    :ivar model: the model name the agent's client sends.
    :ivar message_timeout_s: how long one reset or step may take.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = ""
    action_field: str = "message"
    observation_field: str | None = None
    system_prompt: str = ""
    max_steps: int = Field(default=8, ge=1)
    reset_args: dict[str, Any] = Field(default_factory=dict)
    model: str = "policy"
    message_timeout_s: float = Field(default=60.0, gt=0)
