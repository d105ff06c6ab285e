"""The solver-verifier episode against a real session server and engine (the tiny random model), run
as the ``agentic`` generator runs it: two roles, one branch each; and its reward per role."""

from __future__ import annotations

import asyncio
import math

import pytest
from example_support import assert_every_model_token_trained_once, branch_shape, run_episode
from miles_contracts import Sample
from solver_verifier.agent import run_agent, verdict_of
from solver_verifier.reward import solver_verifier


@pytest.mark.slow
def test_the_verifier_judges_the_solver_in_a_session_of_its_own_role(session_server_url: str) -> None:
    sample, view = asyncio.run(run_episode(session_server_url, run_agent, "What is 6 * 7?", label="42", role="solver"))
    result = sample.metadata["agent_result"]

    (verifier,) = view.children
    assert (view.role, verifier.role) == ("solver", "verifier")
    assert verifier.parent is not None and (verifier.parent.session_id, verifier.parent.turn) == (view.session_id, 0)
    assert (len(view.records), len(verifier.records)) == (1, 1)
    assert branch_shape(sample) == [("solver", "root"), ("verifier", "subagent")]
    assert sample.metadata["episode"]["roles"] == ["solver", "verifier"]
    assert result["verdict"] == verdict_of(result["verifier_reply"])
    # the verifier was shown the solver's answer
    assert result["answer"] in verifier.messages[1]["content"]
    assert_every_model_token_trained_once(sample, view)

    (rewards,) = solver_verifier([sample])
    assert isinstance(rewards, dict) and set(rewards) == {"solver", "verifier"}
    # rows() gives the verifier's row the verifier's reward (what the loop trains it with)
    sample.role_rewards, sample.reward = rewards, rewards["solver"]
    assert [row.reward for row in sample.rows()] == [rewards["solver"], rewards["verifier"]]


def episode(answer: str, verdict: str, label: str | None = "42") -> Sample:
    return Sample(prompt="What is 6 * 7?", label=label, metadata={"agent_result": {"answer": answer, "verdict": verdict}})


def test_the_reward_scores_the_solver_and_whether_the_verdict_is_right() -> None:
    assert solver_verifier([
        episode("Answer: 42", "yes"),  # right answer, rightly accepted
        episode("Answer: 42", "no"),   # right answer, wrongly rejected
        episode("Answer: 41", "no"),   # wrong answer, rightly rejected
        episode("Answer: 41", "yes"),  # wrong answer, wrongly accepted
    ]) == [{"solver": 1.0, "verifier": 1.0}, {"solver": 1.0, "verifier": 0.0},
           {"solver": 0.0, "verifier": 1.0}, {"solver": 0.0, "verifier": 0.0}]


def test_an_episode_without_a_label_or_a_verdict_cannot_be_scored() -> None:
    unscorable = [episode("Answer: 42", "yes", label=None), episode("Answer: 42", "maybe"), Sample(prompt="x", label="1")]
    assert all(math.isnan(score) for score in solver_verifier(unscorable))  # type: ignore[arg-type]


def test_a_verdict_is_yes_only_when_the_reply_starts_with_it() -> None:
    assert [verdict_of(r) for r in ("Yes.", " yes, it is", "**YES**", "no", "I think yes", "yesterday")] == \
        ["yes", "yes", "yes", "no", "no", "no"]


def test_the_agent_and_the_reward_are_registered_by_the_entry_point() -> None:
    from miles.context import context_for

    kernel = context_for().kernel
    assert kernel.agents().entry("solver_verifier").distribution == "miles-example-solver-verifier"
    assert kernel.rewards().entry("solver_verifier").distribution == "miles-example-solver-verifier"
