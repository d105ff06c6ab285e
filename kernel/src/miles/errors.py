"""Errors the kernel raises at users. Every message says what was wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MilesError(Exception):
    """Base class of every error Miles raises for bad input or setup."""


class PluginError(MilesError):
    """A plugin could not be loaded, validated or found."""


class ConfigError(MilesError):
    """The config is invalid. ``errors`` holds one ``"path: message"`` line per problem."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = list(errors)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"found {len(self.errors)} error(s){where}:\n{lines}")


class MilesDeprecationWarning(DeprecationWarning):
    """A plugin uses an API that goes away in a later release (the message names the replacement).

    The ``miles`` CLI shows these (Python hides plain ``DeprecationWarning`` outside ``__main__``).
    """


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The one of ``known`` that ``name`` most likely misspells (difflib's ratio >= 0.6), or None:
    what every "unknown ..." message offers as "did you mean"."""
    matches = difflib.get_close_matches(name, list(known), n=1)
    return matches[0] if matches else None
