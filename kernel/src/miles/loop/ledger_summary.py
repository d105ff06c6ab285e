"""What the sample ledger counts per data epoch (:class:`EpochSummary`), and the running counts of
an endless source's open epoch (``ledger/open_epoch.json``): the parts of :mod:`miles.loop.ledger`
that read and write summaries rather than events."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles import bounded_json
from miles.errors import MilesError

OPEN_FILE = "open_epoch.json"


class LedgerError(MilesError):
    """The ledger says a prompt was lost or trained twice (a bug in the loop), or cannot be read."""


@dataclass
class EpochSummary:
    epoch: int
    prompts: int | None  # the source's size (None: not known)
    drawn: int = 0
    trained: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    recycled: Counter[str] = field(default_factory=Counter)
    aborted: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    redrawn: int = 0
    lost: int = 0
    duplicated: int = 0
    closed: bool = False

    def add(self, other: EpochSummary) -> None:
        """Count ``other``'s prompts too (a fold of settled draws of the same open epoch)."""
        self.drawn += other.drawn
        self.trained += other.trained
        self.redrawn += other.redrawn
        self.duplicated += other.duplicated
        for mine, theirs in ((self.filtered, other.filtered), (self.dropped, other.dropped),
                             (self.recycled, other.recycled), (self.aborted, other.aborted)):
            mine.update(theirs)

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "prompts": self.prompts, "drawn": self.drawn, "trained": self.trained,
                "filtered": dict(self.filtered), "dropped": dict(self.dropped), "recycled": dict(self.recycled),
                "aborted": dict(self.aborted), "in_flight": self.in_flight, "redrawn": self.redrawn, "lost": self.lost,
                "duplicated": self.duplicated, "closed": self.closed}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> EpochSummary:
        return cls(int(row["epoch"]), row.get("prompts"), int(row.get("drawn", 0)), int(row["trained"]),
                   Counter(row.get("filtered", {})), Counter(row.get("dropped", {})), Counter(row.get("recycled", {})),
                   Counter(row.get("aborted", {})), int(row.get("in_flight", 0)), int(row.get("redrawn", 0)),
                   int(row["lost"]),
                   int(row["duplicated"]), bool(row.get("closed", True)))


def read_folds(path: Path) -> tuple[dict[int, EpochSummary], set[int]]:
    """``open_epoch.json``: the running counts of open epochs' settled draws (endless sources),
    and the groups its latest fold took (their lines may still be in the events file)."""
    if not path.is_file():
        return {}, set()
    try:
        data = bounded_json.loads(path.read_text())
        return ({int(row["epoch"]): EpochSummary.from_json(row) for row in data["epochs"]},
                {int(g) for g in data["groups"]})
    except (KeyError, TypeError, ValueError) as exc:
        raise LedgerError(f"{path}: not the ledger's open-epoch counts ({exc!r}); the ledger was edited or "
                          f"damaged") from None


def write_folds(path: Path, folded: Mapping[int, EpochSummary], groups: set[int]) -> None:
    """Replace ``open_epoch.json`` (a temporary file, synced, renamed: never half written)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"epochs": [s.to_json() for s in folded.values()], "groups": sorted(groups)}))
    with tmp.open() as f:
        os.fsync(f.fileno())
    tmp.replace(path)


__all__ = ["OPEN_FILE", "EpochSummary", "LedgerError", "read_folds", "write_folds"]
