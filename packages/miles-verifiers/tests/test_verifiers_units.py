"""The verifiers data source, reward and config errors on the demo environments (no model needed)."""

from __future__ import annotations

import math

import pytest
from miles_contracts import Sample
from miles_verifiers.agent import rubric_reward
from miles_verifiers.loading import VerifiersConfigError, load_environment
from miles_verifiers.section import VerifiersSection
from miles_verifiers.source import VerifiersDataSource


def test_the_dataset_rows_become_prompts_with_what_the_rollout_needs() -> None:
    env = load_environment(VerifiersSection(environment="miles_verifiers.demo_envs.adder_tools", args={"count": 3}))
    source = VerifiersDataSource([dict(r) for r in env.get_dataset()])
    first = source.next_prompts(2)
    assert [m["role"] for m in first[0].prompt] == ["system", "user"]  # type: ignore[union-attr]
    assert first[0].label == first[0].metadata["verifiers"]["answer"] and first[0].metadata["verifiers"]["example_id"] == 0
    state = source.state_dict()
    again = VerifiersDataSource([dict(r) for r in env.get_dataset()])
    again.load_state_dict(state)
    [third, wrapped] = again.next_prompts(2)  # resumes where it was, then wraps around the 3 rows
    assert third.metadata["verifiers"]["example_id"] == 2 and wrapped.prompt == first[0].prompt
    assert env.tool_defs and env.tool_defs[0].name == "add"  # the environment offers its tool


def test_the_reward_is_the_rubric_score_and_nan_when_unscored() -> None:
    scored = Sample(metadata={"agent_result": {"reward": 1.0}})
    assert rubric_reward([scored, Sample()])[0] == 1.0 and math.isnan(rubric_reward([Sample()])[0])


@pytest.mark.parametrize("environment", ["", "no_such_verifiers_environment"])
def test_an_environment_that_does_not_load_is_a_clear_error(environment: str) -> None:
    with pytest.raises(VerifiersConfigError, match="verifiers.environment"):
        load_environment(VerifiersSection(environment=environment))
