"""One mini-swe-agent episode outside a run, as a conformance suite runs it: a session on the tiny
model's session server, a sandbox service on this process's thread, the agent from
``swe_agent(sandbox_url)``; the session's turns are the episode's, each model token trained once."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from example_support import assert_every_model_token_trained_once, run_episode

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]
EXAMPLE = Path(__file__).resolve().parents[1]


def test_an_episode_records_its_turns_and_scores_in_the_sandbox(session_server_url: str) -> None:
    from miles_contracts.wire.auth import run_token
    from miles_sandbox.config import SandboxSection
    from miles_sandbox.server import SandboxServer
    from miles_sandbox.swe.agent import swe_agent

    row = json.loads((EXAMPLE / "tasks.jsonl").read_text().splitlines()[0])
    section = SandboxSection(templates_dir=str(EXAMPLE / "tasks"), pool_size=1)
    with SandboxServer(section, token=run_token() or "") as sandbox:
        agent = swe_agent(sandbox.url, max_turns=2)
        sample, view = asyncio.run(run_episode(session_server_url, agent, row["prompt"],
                                               metadata={"settings": row["settings"]}))
    result = sample.metadata["agent_result"]
    assert result["model_calls"] == len(view.records) >= 1
    assert result["tests"]["total"] == 3 and "Ran 3 tests" in result["tests"]["output"]
    assert view.records[0].message["role"] == "assistant"
    assert_every_model_token_trained_once(sample, view)
