"""`Command` (before 0.2: what a plugin registered to add a ``miles`` sub-command; now
:class:`miles_contracts.CommandSpec`, whose ``run`` also gets the CLI's run context) and
:func:`emit_json`, the last call of every ``miles bench`` command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Command:
    """A CLI command of the pre-spec style (its ``run`` takes the arguments only). Registered, it
    is adapted to a :class:`~miles_contracts.CommandSpec` with a deprecation warning; register a
    ``CommandSpec`` instead.

    :ivar help: one line shown in ``miles --help``.
    :ivar run: called with the parsed arguments; returns the exit code (None means 0).
    :ivar add_arguments: adds the command's arguments to its parser.
    :ivar description: longer text for ``miles <command> --help``.
    """

    help: str
    run: Callable[[argparse.Namespace], int | None]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None


def emit_json(report: Any, out: str | Path | None = None) -> None:
    """Print a benchmark's JSON report on stdout and, when ``out`` is given, write it there too
    (parent folders created): what every ``miles bench`` command ends with."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
