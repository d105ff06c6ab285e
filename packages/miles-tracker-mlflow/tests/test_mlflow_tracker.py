"""The mlflow tracker writes to a local file store under the run folder, read back from its files."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.sections import RunSection, TrackingSection
from miles.tracking import open_trackers
from miles_contracts import Process
from miles_tracker_mlflow.tracker import mlflow_metric_name


def metric_file_rows(path: Path) -> list[tuple[float, int]]:
    """An MLflow file-store metric file: one ``<timestamp ms> <value> <step>`` line per point."""
    rows = []
    for line in path.read_text().splitlines():
        _timestamp, value, step = line.split()
        rows.append((float(value), int(step)))
    return rows


@pytest.fixture
def kernel() -> Kernel:
    selection = PluginSelection(enable=("mlflow", "trackers"))
    return Kernel(load_plugins(selection), selection)


def test_metric_names_are_made_acceptable_to_mlflow() -> None:
    assert mlflow_metric_name("eval/pass@4") == "eval/pass_4"
    assert mlflow_metric_name("perf/tokens per s:gen-1.0") == "perf/tokens per s:gen-1.0"


def test_logged_steps_read_back_from_the_file_store(kernel: Kernel, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = MilesConfig(run=RunSection(name="mlflow-demo"), tracking=TrackingSection(trackers=["mlflow"], project="miles-tests"))
    run_folder = tmp_path / "mlflow-demo"  # the MLflow run is named after the run folder
    ctx = context_for(config, Process.driver(), run_dir=run_folder, kernel=kernel)
    logger = open_trackers(ctx)
    for step in (1, 2, 3):
        logger.log({"reward/mean": step / 4, "eval/pass@4": 1.0, "skipped": float("nan")}, step=step)
    logger.close()

    run_id = (run_folder / "mlflow-run-id").read_text()
    [run_dir] = (run_folder / "mlruns").glob(f"*/{run_id}")
    assert metric_file_rows(run_dir / "metrics" / "reward" / "mean") == [(0.25, 1), (0.5, 2), (0.75, 3)]
    assert metric_file_rows(run_dir / "metrics" / "eval" / "pass_4") == [(1.0, 1), (1.0, 2), (1.0, 3)]
    assert not (run_dir / "metrics" / "skipped").exists()
    assert "status: 3" in (run_dir / "meta.yaml").read_text()  # RunStatus.FINISHED
    assert (run_dir / "tags" / "mlflow.runName").read_text() == "mlflow-demo"
    assert "name: mlflow-demo" in (run_dir / "artifacts" / "config.yaml").read_text()

    resumed = open_trackers(ctx)
    resumed.log({"reward/mean": 1.0}, step=4)
    resumed.close()
    assert metric_file_rows(run_dir / "metrics" / "reward" / "mean")[-1] == (1.0, 4)
