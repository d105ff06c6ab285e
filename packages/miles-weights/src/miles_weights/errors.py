"""Errors of a weight sync. Each message names the engine, the step and what the engine said."""

from __future__ import annotations

from miles.errors import MilesError


class WeightSyncError(MilesError):
    """A weight sync did not complete.

    Engines that were paused stay paused with possibly partial weights and their old
    ``weight_version``: nothing was lost on the trainer side, and calling ``push`` again resends
    every tensor (pausing is idempotent).
    """


class WeightCheckError(WeightSyncError):
    """Check mode found engine tensors that differ from the trainer's after a sync.

    :ivar mismatches: ``{engine_url: [hf_name, ...]}`` of the tensors that differ.
    """

    def __init__(self, message: str, mismatches: dict[str, list[str]]) -> None:
        super().__init__(message)
        self.mismatches = mismatches
