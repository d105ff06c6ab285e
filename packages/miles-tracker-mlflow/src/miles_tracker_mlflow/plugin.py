"""Miles plugin ``mlflow``: the ``mlflow`` tracker and the ``mlflow`` config section.

mlflow itself is imported only when a run starts the tracker.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, TrackerSpec

from miles_tracker_mlflow.config import MlflowSection
from miles_tracker_mlflow.tracker import mlflow_tracker


@hookimpl
def miles_register_trackers(register: Register[TrackerSpec]) -> None:
    register("mlflow", TrackerSpec(mlflow_tracker))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("mlflow", ConfigSectionSpec(MlflowSection))
