"""``miles train`` end to end with the solver-verifier episode and its reward per role: the tiny
random model, 2 steps of 2 prompts x 2 samples."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_support import TrainRuns, dumped, metrics

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).resolve().parents[1] / "config.yaml"
OVERRIDES: tuple[str, ...] = ()  # the run: started with the other examples' (conftest.py)


def test_two_steps_train_on_solver_verifier_episodes(train_runs: TrainRuns) -> None:
    run = train_runs.finished(CONFIG, *OVERRIDES)  # raises unless the run exited with status 0
    assert [m["step"] for m in metrics(run)] == [1, 2]
    for step in (1, 2):
        for episode in dumped(run, step):
            assert episode["status"] in ("completed", "truncated"), episode["exit_detail"]
            assert len(episode["weight_versions"]) == 1  # the solver's one turn
            assert episode["branch"]["role"] == "solver" and set(episode["role_rewards"]) == {"solver", "verifier"}
            assert episode["reward"] == episode["role_rewards"]["solver"]
            (verifier,) = episode["branches"]
            assert verifier["branch"]["role"] == "verifier" and len(verifier["weight_versions"]) == 1
            assert verifier["reward"] == episode["role_rewards"]["verifier"]
    for m in metrics(run):
        assert m["reward/scored"] == 4 and m["rollout/role/verifier/rows"] == 4
