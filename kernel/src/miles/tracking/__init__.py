"""Tracking: the run's metrics go to ``metrics.jsonl`` (always) and to the trackers named in
``tracking.trackers`` (TensorBoard, W&B, MLflow ... each a plugin). The loop calls
:func:`open_trackers` once and ``log(metrics, step)`` every step."""

from miles.tracking.jsonl import METRICS_FILE, JsonlTracker, read_metrics
from miles.tracking.logger import MetricsLogger, open_trackers

__all__ = ["METRICS_FILE", "JsonlTracker", "MetricsLogger", "open_trackers", "read_metrics"]
