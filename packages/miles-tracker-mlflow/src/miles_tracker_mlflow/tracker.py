"""``MlflowTracker``: an MLflow run per Miles run, by default in a file store under the run folder.

Without ``mlflow.tracking_uri`` (or ``MLFLOW_TRACKING_URI``) metrics go to the local file store
``runs/<name>/mlruns`` (view with ``mlflow ui --backend-store-uri runs/<name>/mlruns``). MLflow 3
keeps the file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; the tracker sets that
variable (unless already set) only when it uses a file store. MLflow allows letters, digits and
``_ - . : / space`` in metric names, so other characters become ``_`` (``eval/pass@4`` is logged
as ``eval/pass_4``). The MLflow run id is kept in ``runs/<name>/mlflow-run-id`` so that
``miles train --resume`` continues the same MLflow run; the resolved config is logged as the
artifact ``config.yaml``.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_tracker_mlflow.config import MlflowSection

if TYPE_CHECKING:
    from miles_contracts import RunContext

RUN_ID_FILE = "mlflow-run-id"
STORE_SUBDIR = "mlruns"
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_\-.: /]")


def mlflow_metric_name(name: str) -> str:
    return _NOT_ALLOWED.sub("_", name)


class MlflowTracker:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [
            Metric(mlflow_metric_name(name), float(value), now, step)
            for name, value in metrics.items()
            if math.isfinite(float(value))
        ]
        for start in range(0, len(entries), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=entries[start : start + MAX_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def resolve_tracking_uri(section: MlflowSection, run_dir: Path) -> str:
    uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / STORE_SUBDIR).resolve().as_uri()
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def mlflow_tracker(ctx: RunContext) -> MlflowTracker:
    """The tracker of the run of ``ctx`` (in the driver; it writes under the run folder)."""
    config, run_dir = ctx.config, ctx.require_run_dir("the mlflow tracker")
    from mlflow.tracking import MlflowClient

    section = config.section("mlflow", MlflowSection)
    run_dir.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=resolve_tracking_uri(section, run_dir))
    id_file = run_dir / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
        client.update_run(run_id, status="RUNNING")
    else:
        name = section.experiment or config.tracking.project
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_id = client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        client.log_text(run_id, config.to_yaml(), "config.yaml")
        id_file.write_text(run_id)
    return MlflowTracker(client, run_id)
