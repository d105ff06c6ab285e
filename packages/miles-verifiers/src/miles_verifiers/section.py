"""The ``verifiers`` config section: which verifiers environment a run trains on."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class VerifiersSection(BaseModel):
    """``verifiers:`` in a run's config.

    :ivar environment: the verifiers environment id, as ``vf.load_environment`` takes it: the
        installed module (``vf-math-python`` reads as ``vf_math_python``) whose ``load_environment``
        builds the environment. Needed by the ``verifiers`` data source and agent.
    :ivar args: keyword arguments of that ``load_environment``.
    :ivar model: the model name the environment's client sends (the session server serves the
        run's policy under any name).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: str = ""
    args: dict[str, Any] = Field(default_factory=dict)
    model: str = "policy"
