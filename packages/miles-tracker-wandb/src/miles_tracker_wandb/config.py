"""The ``wandb`` config section (optional; every key has a default)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WandbSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="None: the WANDB_MODE environment variable, else online"
    )
    project: str | None = Field(default=None, description="default: tracking.project")
    entity: str | None = None
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
