"""The delegating agent (``openai`` main agent, ``anthropic`` sub-agent) against a real session server
and engine (the tiny random model), run as the ``agentic`` generator runs it: the episode's graph
of two sessions and its rows."""

from __future__ import annotations

import asyncio

import pytest
from delegating_agent.agent import messages_kwargs, run_agent
from example_support import assert_every_model_token_trained_once, branch_shape, run_episode

pytestmark = pytest.mark.slow


def test_the_subagent_runs_in_a_child_session_whose_turns_are_a_branch_of_the_episode(session_server_url: str) -> None:
    sample, view = asyncio.run(run_episode(session_server_url, run_agent, "What is 6 * 7?", label="42"))
    result = sample.metadata["agent_result"]

    (child,) = view.children
    assert child.session_id == result["subagent_session"] and child.role == "subagent"
    assert child.parent is not None and (child.parent.session_id, child.parent.turn) == (view.session_id, 0)
    assert child.episode_id == view.episode_id
    # two Messages API turns in the child (the second re-sends the first reply: one branch), two chat turns in the main
    assert (len(view.records), len(child.records)) == (2, 2)
    assert sample.metadata["episode"] == {"episode_id": view.episode_id, "sessions": 2, "branches": 2, "rows": 2,
                                          "forks": {"subagent": 1}, "roles": ["agent", "subagent"]}
    assert branch_shape(sample) == [("agent", "root"), ("subagent", "subagent")]
    (sub,) = sample.branches
    assert sub.branch is not None and (sub.branch.parent_branch, sub.branch.fork_turn) == (0, 0)
    assert sub.branch.session_id == child.session_id
    # the main agent saw the helper's answer before answering
    helper_turn = sample.metadata["messages"][3]
    assert helper_turn["role"] == "user" and helper_turn["content"].startswith("Your helper answered: ")
    assert sample.response == result["answer"]
    assert_every_model_token_trained_once(sample, view)


def test_the_runs_sampling_reaches_the_messages_api_in_its_names() -> None:
    kwargs = messages_kwargs({"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stop": "\n", "extra_body": {"top_k": 4}})
    assert kwargs == {"max_tokens": 8, "stop_sequences": ["\n"], "extra_body": {"temperature": 0.5, "top_p": 0.9, "top_k": 4}}
    assert messages_kwargs({"max_tokens": 8}) == {"max_tokens": 8}


def test_the_agent_is_registered_by_its_entry_point() -> None:
    from miles.context import context_for

    entry = context_for().kernel.agents().entry("delegating_agent")
    assert entry.distribution == "miles-example-delegating-agent"
