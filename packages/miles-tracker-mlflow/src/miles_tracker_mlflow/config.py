"""The ``mlflow`` config section (optional; every key has a default)."""

from __future__ import annotations

from typing import Annotated

from miles.sections import Privileged
from pydantic import BaseModel, ConfigDict, Field


class MlflowSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tracking_uri: Annotated[str | None, Privileged("a server MLflow sends the environment's credentials to "
                                                   "(MLFLOW_TRACKING_TOKEN, ...)")] = Field(
        default=None, description="None: MLFLOW_TRACKING_URI, else a file store in runs/<name>/mlruns"
    )
    experiment: str | None = Field(default=None, description="default: tracking.project")
