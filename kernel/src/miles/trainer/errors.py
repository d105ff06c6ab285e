"""What can go wrong between the driver and its trainer ranks."""

from __future__ import annotations

from miles.errors import MilesError


class TrainerRankError(MilesError):
    """A trainer rank died, or failed in a way that leaves the ranks out of step: the run stops.

    :ivar rank: the rank that failed.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class TrainerCallError(MilesError):
    """A call failed on some rank with a :class:`MilesError` (a weight sync that an engine
    refused, say) while every rank finished the call: the ranks are in step and may be called
    again."""
