"""``miles train`` end to end with the delegating agent: the tiny random model, 2 steps of 2 prompts
x 2 samples; each episode is the main agent's session and the sub-agent's child session."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_support import TrainRuns, dumped, metrics

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"
OVERRIDES: tuple[str, ...] = ()  # the run: started with the other examples' (conftest.py)


def test_two_steps_train_on_delegating_episodes(train_runs: TrainRuns) -> None:
    run = train_runs.finished(CONFIG, *OVERRIDES)  # raises unless the run exited with status 0
    assert [m["step"] for m in metrics(run)] == [1, 2]
    for m in metrics(run):
        assert m["rollout/samples"] == 4 and m["reward/scored"] == 4
    for step in (1, 2):
        for episode in dumped(run, step):
            # the last turn may stop at max_new_tokens (truncated): the episode is trained either way
            assert episode["status"] in ("completed", "truncated"), episode["exit_detail"]
            # the primary row is the main agent's: its plan and its answer are trained there
            assert len(episode["weight_versions"]) == 2 and sum(episode["loss_mask"]) > 0
            # a loop that trains every branch also dumps them: the sub-agent's two turns
            for branch in episode.get("branches", []):
                assert (branch["branch"]["role"], len(branch["weight_versions"])) == ("subagent", 2)
