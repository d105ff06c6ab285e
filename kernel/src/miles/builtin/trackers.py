"""Built-in plugin ``trackers``: the always-on ``jsonl`` tracker (``runs/<name>/metrics.jsonl``)."""

from __future__ import annotations

from miles_contracts import TrackerSpec

from miles.hookspecs import hookimpl
from miles.registry import Register
from miles.tracking.jsonl import jsonl_tracker


@hookimpl
def miles_register_trackers(register: Register[TrackerSpec]) -> None:
    register("jsonl", TrackerSpec(jsonl_tracker))
