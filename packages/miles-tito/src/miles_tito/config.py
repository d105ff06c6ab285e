"""The ``tito`` config section (registered by this plugin; the kernel's ``rollout`` section holds
the generator, tools, agent, agent_timeout and max_turns)."""

from __future__ import annotations

from typing import Annotated, Literal

from miles.sections import Choice, Privileged, Section
from pydantic import Field


class TitoSection(Section):
    family: Annotated[str, Choice("chat_family")] | None = Field(
        default=None, description="registered chat family; default: the one the model's bridge names"
    )
    session_server_url: Annotated[str | None, Privileged("a server the run's token is sent to")] = Field(
        default=None,
        description="session server the agentic generator uses; default: the run's, else one started in-process",
    )
    render_check: Literal["window", "full"] = Field(
        default="window",
        description="history rendered around appended messages: the last turn (window) or all of it (full)",
    )
    max_rollback_turns: int = Field(default=1, ge=0, description="generated turns one request may retry")
    session_idle_timeout: float = Field(
        default=3600.0, ge=0, description="seconds without a request after which a session expires (0: never)",
    )
    tool_timeout: float = Field(default=60.0, gt=0, description="seconds one tool call of multi_turn may take")
    collect_timeout: float = Field(default=600.0, gt=0, description="seconds to wait for a session's records")
