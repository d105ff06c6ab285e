"""JSON from outside (request bodies, data files) with a bound on how deeply it nests.

``json.loads`` recurses once per nested array or object, so a line of ten thousand ``[`` raises
``RecursionError`` -- not a ``ValueError``, so it passed every ``except ValueError`` meant for bad
JSON and became a 500 or stopped a data source. A document just under Python's recursion limit
parses, and then fails in whatever walks it next (``json.dumps`` when the router forwards it, a
deep copy, a pickle), in another place and with a worse message. :func:`loads` refuses both with
:class:`NestedTooDeep`: no request or record Miles reads needs more than :data:`MAX_DEPTH` levels
(a chat request with tool schemas nests about a dozen), and everything that walks the value later
has room to spare below the interpreter's limit (1000 frames).
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 100


class NestedTooDeep(ValueError):
    """The document nests arrays and objects deeper than allowed; the message says how deep."""


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, or :class:`NestedTooDeep` when arrays and objects nest deeper than
    ``max_depth`` levels (``[]`` and ``{}`` are one level; scalars none). ``json.JSONDecodeError``
    passes through for malformed JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise NestedTooDeep(_too_deep(max_depth)) from None
    # A document cannot nest deeper than it has openings: counting them (at C speed) spares the
    # walk for every ordinary request, whose few brackets are far below the limit.
    openings = text.count(b"[") + text.count(b"{") if isinstance(text, bytes) else text.count("[") + text.count("{")
    if openings > max_depth and depth_exceeds(value, max_depth):
        raise NestedTooDeep(_too_deep(max_depth))
    return value


def depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether lists and dicts in ``value`` nest deeper than ``max_depth`` levels; without
    recursion, so it works at any depth."""
    pending: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while pending:
        node, depth = pending.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _too_deep(max_depth: int) -> str:
    return f"JSON arrays and objects nest deeper than {max_depth} levels"
