"""Miles plugin ``prometheus``: the ``prometheus`` tracker and the ``prometheus`` config section.

prometheus-client is imported only when a run starts the tracker.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, TrackerSpec

from miles_tracker_prometheus.config import PrometheusSection
from miles_tracker_prometheus.tracker import prometheus_tracker


@hookimpl
def miles_register_trackers(register: Register[TrackerSpec]) -> None:
    register("prometheus", TrackerSpec(prometheus_tracker))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("prometheus", ConfigSectionSpec(PrometheusSection))
