"""Comparing engine ``weight_version`` values.

Miles versions are integers (SGLang sends them as strings, e.g. ``"7"``), so two versions that both
read as integers are ordered numerically. Anything else (SGLang's default ``"default"``) is opaque:
only equal or different. ``None`` means the engine does not say, and nothing is checked.
"""

from __future__ import annotations

import collections


def as_version(value: object) -> str | None:
    """The wire value (``str | int | None``) as the router stores it."""
    if value is None:
        return None
    return str(value)


def _as_int(version: str) -> int | None:
    try:
        return int(version)
    except ValueError:
        return None


def is_behind(version: str | None, reference: str | None) -> bool:
    """Whether a worker at ``version`` would serve older weights than ``reference``."""
    if version is None or reference is None:
        return False
    ours, theirs = _as_int(version), _as_int(reference)
    if ours is not None and theirs is not None:
        return ours < theirs
    return version != reference


def is_newer(version: str, reference: str | None) -> bool:
    """Whether ``version`` is a later numeric version than ``reference`` (opaque: never)."""
    if reference is None:
        return True
    ours, theirs = _as_int(version), _as_int(reference)
    return ours is not None and theirs is not None and ours > theirs


def went_backwards(previous: str | None, current: str | None) -> bool:
    """A numeric version that decreased: the engine restarted and lost its weight updates."""
    if previous is None or current is None:
        return False
    before, now = _as_int(previous), _as_int(current)
    return before is not None and now is not None and now < before


def all_numeric(versions: list[str]) -> bool:
    return all(_as_int(v) is not None for v in versions)


def newest(versions: list[str]) -> str:
    """The highest of numeric versions."""
    return max(versions, key=lambda v: _as_int(v) or 0)


def consensus(versions: list[str]) -> str:
    """The version a group of workers stands for: the newest if numeric, else the most common."""
    if all_numeric(versions):
        return newest(versions)
    return collections.Counter(versions).most_common(1)[0][0]


def majority(versions: list[str]) -> str:
    """The newest numeric version that a strict majority of ``versions`` has reached: one worker
    claiming a version far ahead of the others does not move it."""
    ordered = sorted(versions, key=lambda v: _as_int(v) or 0, reverse=True)
    return ordered[len(ordered) // 2]
