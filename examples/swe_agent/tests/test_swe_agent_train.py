"""``miles train examples/swe_agent/config.yaml`` end to end on CPU: the tiny random model, the
run's sandbox service (bubblewrap), mini-swe-agent as the agent, 2 steps of 2 tasks x 2 episodes,
2 harness steps each. The tiny model writes no valid action: what is checked is the path (services
started, episodes recorded and trained, the tests run in the sandbox and scored), not learning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from example_support import TrainRuns, dumped, metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]
CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"
# the run: started with the other examples' (conftest.py)
OVERRIDES = ("rollout.max_turns=2", "rollout.max_new_tokens=16", "sandbox.pool_size=4", "data.options={}")


def test_two_steps_of_mini_swe_agent_in_the_sandbox(train_runs: TrainRuns) -> None:
    run = train_runs.finished(CONFIG, *OVERRIDES)  # raises unless the run exited with status 0
    services = {row["role"]: row for row in json.loads((run / "services.json").read_text()) if "role" in row}
    assert services["sandbox"]["pid"] and services["sandbox"]["url"].startswith("http://127.0.0.1:")
    assert [m["step"] for m in metrics(run)] == [1, 2]
    for step in (1, 2):
        for episode in dumped(run, step):
            assert episode["status"] in ("completed", "truncated"), episode["exit_detail"]
            result = episode["metadata"]["agent_result"]
            assert result["model_calls"] >= 1
            tests = result["tests"]  # run in the sandbox after the harness: buggy code fails some
            assert tests["total"] == 3 and 0 <= tests["passed"] < 3 and "Ran 3 tests" in tests["output"]
            assert episode["reward"] == pytest.approx(tests["passed"] / 3)
            assert sum(episode["loss_mask"]) > 0
