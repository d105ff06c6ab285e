"""Miles plugin ``tensorboard``: the ``tensorboard`` tracker (tensorboardX is imported on use)."""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import TrackerSpec

from miles_tracker_tensorboard.tracker import tensorboard_tracker


@hookimpl
def miles_register_trackers(register: Register[TrackerSpec]) -> None:
    register("tensorboard", TrackerSpec(tensorboard_tracker))
