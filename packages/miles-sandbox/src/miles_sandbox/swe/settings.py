"""A SWE task row's ``settings.agent`` (validated when the data opens): how its tests are run."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SweAgentSettings(BaseModel):
    """:ivar tests: template paths put back as shipped before scoring (the agent may edit its copy).
    :ivar test_command: runs the tests in the workspace; its output must be ``unittest``'s.
    :ivar n_tests: tests the task has (the score's denominator: a module broken so badly that fewer
        tests run still scores against all of them).
    :ivar step_limit: model calls of the harness (0: ``rollout.max_turns``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tests: list[str] = Field(default_factory=lambda: ["tests"], max_length=64)
    test_command: str = Field(default="python -m unittest -v", max_length=4096)
    n_tests: int = Field(default=1, ge=1)
    step_limit: int = Field(default=0, ge=0)
