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
    max_branches_per_episode: int = Field(
        default=64, ge=1, description="branches of one episode's trajectory graph (forks, retries, sub-agents); over it "
                                      "the episode ends (exit reason episode_limit)")
    max_sessions_per_episode: int = Field(default=16, ge=1, description="sessions of one episode (its sub-agents and roles)")
    max_tokens_per_episode: int = Field(
        default=1 << 20, ge=1, description="tokens one episode's turns add (prompt increments and sampled ids)")
    agent_role: str = Field(
        default="agent", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="role of the episode's first session (the one the agentic generator opens; its agent opens the others)")
    train_retried: bool = Field(
        default=False, description="train the turns of a branch a client abandoned by retrying them (default: keep, do not train)")
    session_idle_timeout: float = Field(
        default=3600.0, ge=0, description="seconds without a request after which a session expires (0: never)",
    )
    tool_timeout: float = Field(default=60.0, gt=0, description="seconds one tool call of multi_turn may take")
    tool_timeout_budget: int = Field(
        default=0, ge=0, description="tool calls of multi_turn that may time out before the episode ends (exit reason "
                                     "tool_timeout_budget); a tolerated one answers the model with an error text")
    collect_timeout: float = Field(default=600.0, gt=0, description="seconds to wait for a session's records")
