"""`Command`: what a plugin registers to add a ``miles`` sub-command."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    """A CLI command.

    :ivar help: one line shown in ``miles --help``.
    :ivar run: called with the parsed arguments; returns the exit code (None means 0).
    :ivar add_arguments: adds the command's arguments to its parser.
    :ivar description: longer text for ``miles <command> --help``.
    """

    help: str
    run: Callable[[argparse.Namespace], int | None]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None
