"""The compacting agent (real ``openai`` client) against a real session server and engine (the tiny
random model), run as the ``agentic`` generator runs it: the episode's graph and its rows."""

from __future__ import annotations

import asyncio

import pytest
from compacting_agent.agent import NUDGE, compact_every_of, run_agent, summary
from example_support import assert_every_model_token_trained_once, branch_shape, run_episode

pytestmark = pytest.mark.slow


def test_compacting_every_two_turns_makes_a_branch_per_compaction(session_server_url: str) -> None:
    sample, view = asyncio.run(run_episode(session_server_url, run_agent, "What is 6 * 7?", label="42",
                                           metadata={"max_turns": 5, "compact_every": 2}))

    # the tiny model never writes a final answer: 5 turns, compacted before turns 3 and 5
    assert sample.metadata["agent_result"]["turns"] == 5 and sample.metadata["agent_result"]["compactions"] == 2
    assert view.forks == {"compaction": 2} and not view.children
    assert sample.metadata["episode"] == {"episode_id": view.episode_id, "sessions": 1, "branches": 3, "rows": 3,
                                          "forks": {"compaction": 2}, "roles": ["agent"]}
    # the primary is the branch the last turn is on (after the second compaction); the others follow
    assert branch_shape(sample) == [("agent", "compaction"), ("agent", "root"), ("agent", "compaction")]
    assert [row.branch.branch_id for row in [sample, *sample.branches]] == [2, 0, 1]  # type: ignore[union-attr]
    assert [len(row.weight_versions) for row in [sample, *sample.branches]] == [1, 2, 2]  # turns trained per row
    # a compacted branch starts from a fresh prompt (no parent turn), its history replaced by the summary
    assert [row.branch.parent_branch for row in sample.branches] == [None, 0]  # type: ignore[union-attr]
    assert sample.metadata["messages"][1]["content"].startswith("Summary so far: 4 turns done")
    assert sample.response == sample.metadata["agent_result"]["answer"]
    assert_every_model_token_trained_once(sample, view)


def test_a_summary_is_shorter_than_the_nudge_it_replaces() -> None:
    """The server reads a shorter history as a compaction: the summary's own text (without the last
    note, which is cut from a reply the history held) must be shorter than the nudge it drops."""
    fixed = summary("", 99, [""])
    assert len(fixed) < len(NUDGE)
    assert summary("t", 2, ["a  long\nreply " * 10]).count("reply") <= 4  # the note is cut


def test_compact_every_comes_from_the_samples_metadata() -> None:
    assert compact_every_of({}) == 2 and compact_every_of({"compact_every": 3}) == 3
    with pytest.raises(ValueError, match="at least 1"):
        compact_every_of({"compact_every": 0})


def test_the_agent_is_registered_by_its_entry_point() -> None:
    from miles.context import context_for

    entry = context_for().kernel.agents().entry("compacting_agent")
    assert entry.distribution == "miles-example-compacting-agent"
