"""``[CONFIG] [section.key=value ...]``: the arguments every command that reads a run config takes.

One rule, so that ``miles train`` and ``miles config show`` read the same line the same way: an
argument holding ``=`` is an override; a config file, when given, comes first.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from miles.errors import MilesError

METAVAR = "CONFIG|section.key=value"  # argparse shows [CONFIG|section.key=value ...]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the positional ``[CONFIG] [overrides...]`` arguments to ``parser`` as ``items`` (split
    by :func:`split_config_args`)."""
    parser.add_argument("items", nargs="*", metavar=METAVAR,
                        help="a YAML config first (optional; the defaults without one), then overrides: an argument "
                             "holding '=' is an override")


def split_config_args(items: Sequence[str]) -> tuple[Path | None, list[str]]:
    """Split ``[CONFIG] [section.key=value ...]`` into the config path (None: the defaults) and
    the overrides. Raises :class:`MilesError` for a second argument without ``=``."""
    rest = list(items)
    config = Path(rest.pop(0)) if rest and "=" not in rest[0] else None
    stray = [item for item in rest if "=" not in item]
    if stray:
        where = f"after the config {str(config)!r}" if config is not None else "(no config file is given)"
        raise MilesError(f"expected section.key=value overrides {where}, got {stray}; the config file, if any, "
                         f"comes first")
    return config, rest
