"""Errors of data sources."""

from __future__ import annotations

from miles.errors import MilesError


class DataError(MilesError):
    """A data file or data option is unusable; the message names the file (and line) and the fix."""


class RecordProblem(Exception):
    """One record is malformed. Internal: the reader adds the file and line and applies
    ``data.on_error``."""


def require_data_extra(module: str) -> None:
    """Raise a clear error when an optional data dependency is not installed."""
    raise DataError(
        f"reading this data needs the Python package {module!r}, which is not installed: "
        f"pip install 'miles-kernel[data]'"
    )
