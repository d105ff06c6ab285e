"""``MetricsLogger``: the trackers of a run behind one ``log(metrics, step)``.

``jsonl`` always runs and its failures are errors (it is the run's record). Every other tracker
named in ``tracking.trackers`` is best effort once started: a tracker that fails to log (a network
hiccup of an online service) is reported once and tried again at the next step, and never ends
the run. A tracker that cannot *start* is an error at start-up, naming the tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from miles_contracts import Tracker

from miles.errors import PluginError
from miles.tracking.jsonl import jsonl_tracker

if TYPE_CHECKING:
    from miles_contracts import RunContext

logger = logging.getLogger(__name__)
ALWAYS_ON = "jsonl"


class MetricsLogger:
    def __init__(self, record: Tracker, others: Mapping[str, Tracker] | None = None) -> None:
        self.record = record
        self.others = dict(others or {})
        self.failing: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [ALWAYS_ON, *self.others]

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.record.log(metrics, step)
        for name, tracker in self.others.items():
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # noqa: BLE001 -- optional trackers never end a run
                if name not in self.failing:
                    logger.warning("tracker %s failed to log step %d (will keep trying): %s: %s", name, step, type(exc).__name__, exc)
                self.failing.add(name)
            else:
                self.failing.discard(name)

    def close(self) -> None:
        for name, tracker in self.others.items():
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 -- closing the others must not skip the record
                logger.warning("tracker %s failed to close: %s: %s", name, type(exc).__name__, exc)
        self.record.close()


def open_trackers(ctx: RunContext) -> MetricsLogger:
    """Start ``jsonl`` and every tracker of ``tracking.trackers`` for the run of ``ctx`` (its folder)."""
    registry = ctx.kernel.trackers()
    record = registry.get(ALWAYS_ON).create(ctx) if ALWAYS_ON in registry else jsonl_tracker(ctx)
    others: dict[str, Tracker] = {}
    try:
        for name in dict.fromkeys(ctx.config.tracking.trackers):
            if name == ALWAYS_ON:
                continue
            spec = registry.get(name)
            try:
                others[name] = spec.create(ctx)
            except Exception as exc:
                raise PluginError(
                    f"tracker {name!r} ({registry.entry(name).origin}) could not start: {type(exc).__name__}: {exc}. "
                    f"Fix its settings or remove it from tracking.trackers"
                ) from exc
    except BaseException:
        MetricsLogger(record, others).close()
        raise
    return MetricsLogger(record, others)
