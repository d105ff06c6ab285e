"""The ``r3`` config section (registered by this plugin).

Routing replay is off unless a run asks for it::

    r3:
      enabled: true      # record routed experts in rollouts and replay them in training

``plugins.disable: [r3]`` turns it off again without touching the section. For a dense model the
section does nothing (there is no routing to record).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ReplayPhase = Literal["old_logprobs", "train", "ref_logprobs"]


def _default_phases() -> list[ReplayPhase]:
    return ["old_logprobs", "train"]


class R3Section(BaseModel):
    """Options of routing replay."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False, description="ask engines for the experts every token was routed to and replay them in training",
    )
    replay: bool = Field(
        default=True,
        description="force the recorded experts in the trainer's forwards; false: record and report agreement only",
    )
    phases: list[ReplayPhase] = Field(
        default_factory=_default_phases,
        description="forward passes that replay (the actor's; add ref_logprobs to route the reference model alike)",
    )
