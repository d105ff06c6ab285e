"""The always-on jsonl tracker and the fan-out to optional trackers."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.errors import PluginError
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.registry import Register
from miles.sections import TrackingSection
from miles.tracking import METRICS_FILE, open_trackers, read_metrics
from miles_contracts import TrackerSpec


class ListTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []
        self.closed = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True


class Flaky(ListTracker):
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if step == 2:
            raise ConnectionError("service unreachable")
        super().log(metrics, step)


MADE: dict[str, ListTracker] = {}


class TrackersForTests:
    @hookimpl
    def miles_register_trackers(self, register: Register) -> None:
        register("memory", TrackerSpec(lambda ctx: MADE.setdefault("memory", ListTracker())))
        register("flaky", TrackerSpec(lambda ctx: MADE.setdefault("flaky", Flaky())))
        register("broken", TrackerSpec(lambda ctx: (_ for _ in ()).throw(RuntimeError("no API key"))))


@pytest.fixture
def kernel() -> Kernel:
    MADE.clear()
    selection = PluginSelection(enable=("trackers",))
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(TrackersForTests(), "trackers_for_tests")
    return kernel


def config(*trackers: str) -> MilesConfig:
    return MilesConfig(tracking=TrackingSection(trackers=list(trackers)))


def test_jsonl_always_runs_one_flushed_object_per_step(kernel: Kernel, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "demo"
    logger = open_trackers(context_for(config(), run_dir=run_dir, kernel=kernel))  # no tracker named: jsonl anyway
    assert logger.names == ["jsonl"]
    logger.log({"reward/mean": 0.25, "eval/pass@1": float("nan"), "train/steps": 3, "flag": True}, step=1)
    lines = (run_dir / METRICS_FILE).read_text().splitlines()  # readable before close: flushed
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["step"] == 1 and record["reward/mean"] == 0.25 and record["eval/pass@1"] is None
    assert record["train/steps"] == 3 and record["flag"] == 1 and isinstance(record["time"], float)
    logger.log({"reward/mean": 0.5}, step=2)
    logger.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]

    resumed = open_trackers(context_for(config("jsonl"), run_dir=run_dir, kernel=kernel))
    resumed.log({"reward/mean": 0.75}, step=3)
    resumed.close()
    assert [r["reward/mean"] for r in read_metrics(run_dir / METRICS_FILE)] == [0.25, 0.5, 0.75]


def test_jsonl_rejects_bad_metrics(kernel: Kernel, tmp_path: Path) -> None:
    logger = open_trackers(context_for(config(), run_dir=tmp_path, kernel=kernel))
    with pytest.raises(ValueError, match="metric name 'step' is reserved"):
        logger.log({"step": 1.0}, step=1)
    with pytest.raises(TypeError, match="metric 'status' is 'ok'; metrics are numbers"):
        logger.log({"status": "ok"}, step=1)
    logger.close()


def test_optional_trackers_get_every_step_and_a_failing_one_never_ends_the_run(kernel: Kernel, tmp_path: Path, caplog) -> None:
    logger = open_trackers(context_for(config("flaky", "memory", "flaky"), run_dir=tmp_path, kernel=kernel))
    assert logger.names == ["jsonl", "flaky", "memory"]
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            logger.log({"x": float(step)}, step=step)
    logger.close()
    assert [step for step, _ in MADE["memory"].logged] == [1, 2, 3]
    assert [step for step, _ in MADE["flaky"].logged] == [1, 3]
    assert "tracker flaky failed to log step 2 (will keep trying): ConnectionError: service unreachable" in caplog.text
    assert MADE["memory"].closed and MADE["flaky"].closed
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_tracker_that_cannot_start_is_an_error_naming_it(kernel: Kernel, tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=r"tracker 'broken' \(plugin trackers_for_tests\) could not start: RuntimeError: no API key"):
        open_trackers(context_for(config("memory", "broken"), run_dir=tmp_path, kernel=kernel))
    assert MADE["memory"].closed  # trackers already started are closed again


def test_a_resume_supersedes_the_records_of_steps_that_run_again(kernel: Kernel, tmp_path: Path) -> None:
    from miles.tracking.jsonl import SUPERSEDED_FILE, supersede_after

    config = MilesConfig()
    logger = open_trackers(context_for(config, run_dir=tmp_path, kernel=kernel))
    for step in range(1, 8):
        logger.log({"reward/mean": step / 10}, step)
    logger.close()
    with (tmp_path / METRICS_FILE).open("a") as handle:
        handle.write('{"step": 8, "rew')  # a line torn by a crash in mid-write

    # resumed from the checkpoint of step 5: steps 6 and 7 run again, the torn line is unreadable
    assert supersede_after(tmp_path, 5) == 3
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    superseded = (tmp_path / SUPERSEDED_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:2]] == [6, 7] and superseded[2] == '{"step": 8, "rew'

    logger = open_trackers(context_for(config, run_dir=tmp_path, kernel=kernel))  # the resumed run appends after step 5
    logger.log({"reward/mean": 0.65}, 6)
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert supersede_after(tmp_path, 6) == 0  # nothing after the checkpoint: the file is left alone
    assert supersede_after(tmp_path / "no-such-run", 3) == 0
