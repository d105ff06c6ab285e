"""``miles rollout``: the example configs generate and score with the tiny model on CPU (the
embedded engine, the router, the session server for the agent), with no trainer, and write the
step dumps a training run writes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess

ROOT = Path(__file__).resolve().parents[1]


class Rollout:
    """``miles rollout`` started in the background (its stdout, the JSON report, in a file of its
    own), so that the module's two rollouts overlap; :meth:`finished` waits for it."""

    def __init__(self, out: Path, *args: str) -> None:
        self.process = LoggedProcess([sys.executable, "-m", "miles.cli.main", "rollout", *args], out / "rollout.stderr",
                                     stdout_path=out / "rollout.stdout", cwd=ROOT,
                                     env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}).start()

    def finished(self) -> subprocess.CompletedProcess[str]:
        code = self.process.wait_exit("the rollout to finish")
        stdout = self.process.stdout_path.read_text() if self.process.stdout_path else ""
        return subprocess.CompletedProcess(self.process.argv, code, stdout, self.process.output())


@pytest.fixture(scope="module")
def rollouts(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Rollout]]]:
    """The two examples' rollouts, started together: output folder and rollout by example."""
    common = ("run.dump_tokens=true", "rollout.samples_per_prompt=2")
    settings = {
        "arithmetic": ("rollout.prompts_per_step=2", "rollout.max_new_tokens=8"),
        "calculator_agent": ("rollout.prompts_per_step=1", "rollout.max_new_tokens=12", "rollout.max_turns=2"),
    }
    started: dict[str, tuple[Path, Rollout]] = {}
    try:
        for example, extra in settings.items():
            out = tmp_path_factory.mktemp(example)
            started[example] = out, Rollout(out, f"examples/{example}/config.yaml", f"model.name={tiny_dense}",
                                            f"run.output_dir={out}", *common, *extra)
        yield started
    finally:
        for _, rollout in started.values():
            rollout.process.stop()


def _check_run(out: subprocess.CompletedProcess[str], run: Path, samples: int) -> list[dict]:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["run"] == str(run) and [s["step"] for s in report["steps"]] == [1]
    step = report["steps"][0]
    assert step["samples"] == samples and step["metrics"]["reward/scored"] == samples
    dumped = [json.loads(line) for line in (run / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumped) == samples and all(d["reward"] is not None and d["tokens"] for d in dumped)
    assert step["metrics"]["rollout/reward_mean"] == pytest.approx(sum(d["reward"] for d in dumped) / samples)
    # generation only: no trainer rank ran, nothing was checkpointed
    assert not (run / "checkpoints").exists() and not list((run / "logs").glob("trainer*"))
    assert (run / "logs" / "router.log").is_file()
    return dumped


@pytest.mark.slow
def test_rollout_of_the_arithmetic_example(rollouts: dict[str, tuple[Path, Rollout]]) -> None:
    out, rollout = rollouts["arithmetic"]
    dumped = _check_run(rollout.finished(), out / "arithmetic", 4)
    assert all(d["weight_versions"] == [0] for d in dumped)  # the base model's weights, never updated
    assert {d["reward"] for d in dumped} <= {0.0, 1.0}  # exact_match, the example's reward


@pytest.mark.slow
def test_rollout_of_the_calculator_agent_example(rollouts: dict[str, tuple[Path, Rollout]]) -> None:
    out, rollout = rollouts["calculator_agent"]
    dumped = _check_run(rollout.finished(), out / "calculator_agent", 2)
    assert (out / "calculator_agent" / "logs" / "session.log").is_file()  # the agent talked to the session server
    assert all(d["status"] in ("completed", "truncated") and sum(d["loss_mask"]) > 0 for d in dumped)
