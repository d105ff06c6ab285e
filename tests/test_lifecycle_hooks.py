"""The lifecycle hooks fire where and when hookspecs.py says, in a real run.

A probe plugin, installed as a distribution on ``PYTHONPATH`` (a folder with its ``dist-info``,
so every process of the run finds it through the ``miles`` entry points as it would a pip-installed
one), writes one JSON line per hook call with the process it ran in. ``miles train`` then runs two
steps of a tiny model on CPU, and the test reads the order back: ``miles_configure`` in the driver,
in the trainer rank and in every service started from the run's config; ``miles_run_start``
before the first step; per step ``miles_train_step_end`` (trainer rank), ``miles_weights_synced``
and ``miles_step_end`` (driver); ``miles_run_end`` last. A run with ``plugins.disable`` naming
the probe reaches no process at all.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # two real runs of a tiny model, side by side: ~35 s on 2 cores

PROBE = '''
    """Miles plugin ``lifecycle_probe``: appends every lifecycle call to $MILES_PROBE_FILE."""

    import json
    import os

    from miles import hookimpl


    def _record(hook, ctx=None, **fields):
        process = {"kind": ctx.process.kind, "rank": ctx.process.rank, "role": ctx.process.role} if ctx else None
        line = json.dumps({"hook": hook, "pid": os.getpid(), "process": process, **fields})
        with open(os.environ["MILES_PROBE_FILE"], "a") as out:
            out.write(line + "\\n")


    @hookimpl
    def miles_configure(config, ctx):
        _record("configure", ctx, steps=config.run.steps)


    @hookimpl
    def miles_run_start(config, run_dir):
        _record("run_start", run_dir=str(run_dir))


    @hookimpl
    def miles_train_step_end(metrics):
        _record("train_step_end", has_loss="loss" in metrics)


    @hookimpl
    def miles_weights_synced(version):
        _record("weights_synced", version=version)


    @hookimpl
    def miles_step_end(step, metrics):
        metrics["probe/seen"] = 1.0
        _record("step_end", step=step)


    @hookimpl
    def miles_run_end(run_dir, status):
        _record("run_end", status=status)
'''


@pytest.fixture(scope="module")
def probe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the probe as an installed distribution."""
    root = tmp_path_factory.mktemp("probe")
    (root / "lifecycle_probe.py").write_text(textwrap.dedent(PROBE))
    info = root / "lifecycle_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lifecycle-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[miles]\nlifecycle_probe = lifecycle_probe\n")
    return root


class Run:
    """``miles train`` (two steps of the tiny model, the probe on ``PYTHONPATH``) started in the
    background, so that the module's two runs overlap; :meth:`finished` waits for it."""

    def __init__(self, probe: Path, out: Path, name: str, *extra: str) -> None:
        from miles_models.testing import tiny_model

        self.records = out / f"{name}-calls.jsonl"
        self.run = out / name
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MILES_PROBE_FILE": str(self.records),
               "PYTHONPATH": os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        args = [f"model.name={tiny_model('dense')}", f"run.output_dir={out}", f"run.name={name}", "run.steps=2",
                "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
                "reward.name=f1", "run.save_final=false", *extra]
        self.process = LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], out / f"{name}.out",
                                     cwd=ROOT, env=env).start()

    def finished(self) -> list[dict]:
        """The probe's records, once the run has exited with status 0 (``LoggedProcess.finished``)."""
        self.process.finished(f"the {self.run.name} run to finish")
        return _read(self.records)


@pytest.fixture(scope="module")
def runs(probe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The probed run and the run that disables the probe, started together."""
    out = tmp_path_factory.mktemp("runs")
    started: dict[str, Run] = {}
    try:
        started["probed"] = Run(probe_path, out, "probed")
        started["unprobed"] = Run(probe_path, out, "unprobed", "plugins.disable=[lifecycle_probe]")
        yield started
    finally:
        for run in started.values():
            run.process.stop()


def _read(records: Path) -> list[dict]:
    return [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []


def test_lifecycle_hooks_fire_in_their_processes_in_order(runs: dict[str, Run]) -> None:
    calls = runs["probed"].finished()

    configured = [c["process"] for c in calls if c["hook"] == "configure"]
    kinds = sorted((p["kind"], p["rank"], p["role"]) for p in configured)
    assert ("driver", None, None) in kinds and ("trainer-rank", 0, None) in kinds, kinds
    services = {role for kind, _, role in kinds if kind == "service"}
    assert {"router", "engine"} <= services, f"services that did not load the run's plugins: {kinds}"
    assert all(c["steps"] == 2 for c in calls if c["hook"] == "configure")  # each got the run's config

    driver = [c for c in calls if c["hook"] in ("run_start", "weights_synced", "step_end", "run_end")]
    assert len({c["pid"] for c in driver}) == 1  # all in one process: the driver
    driver_pid = next(c["pid"] for c in calls if c["process"] and c["process"]["kind"] == "driver")
    assert driver[0]["pid"] == driver_pid
    order = [(c["hook"], c.get("step", c.get("version", c.get("status")))) for c in driver]
    assert order == [("run_start", None), ("weights_synced", 1), ("step_end", 1), ("weights_synced", 2),
                     ("step_end", 2), ("run_end", "completed")]

    trained = [c for c in calls if c["hook"] == "train_step_end"]
    rank_pid = next(c["pid"] for c in calls if c["process"] and c["process"]["kind"] == "trainer-rank")
    assert [c["pid"] for c in trained] == [rank_pid, rank_pid] and all(c["has_loss"] for c in trained)

    metrics = [json.loads(line) for line in (runs["probed"].run / "metrics.jsonl").read_text().splitlines()]
    assert [m["probe/seen"] for m in metrics] == [1.0, 1.0]  # miles_step_end may add metrics


def test_plugins_disable_keeps_the_probe_out_of_every_process(runs: dict[str, Run]) -> None:
    assert runs["unprobed"].finished() == []
