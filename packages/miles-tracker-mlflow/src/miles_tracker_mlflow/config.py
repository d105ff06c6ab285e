"""The ``mlflow`` config section (optional; every key has a default)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MlflowSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        default=None, description="None: MLFLOW_TRACKING_URI, else a file store in runs/<name>/mlruns"
    )
    experiment: str | None = Field(default=None, description="default: tracking.project")
