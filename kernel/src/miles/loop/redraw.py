"""Prompts drawn again after a resume (the ledger's unsettled draws, from the checkpoint's JSON).

They left the data source before the checkpoint, so they come back from the checkpoint, not the
source: two things the source does to every record must be done to them here.

* **Row settings.** A file source validates each row's ``settings`` with the run's plugins
  (:mod:`miles.data.row_settings`) as it reads the file. A redrawn prompt's settings were
  validated by the run that drew it, whose plugins or rewards a resume may have changed, and the
  checkpoint is a file on disk. They are validated again the same way; one that fails follows
  ``data.on_error``: ``fail`` stops the resume naming every such prompt, ``skip`` drops it in the
  ledger with reason ``invalid_settings`` (counted, never lost).
* **Group size.** ``rollout.samples_per_prompt`` overridden on resume applies to redrawn groups
  as to new ones: a smaller group keeps its first sample ids, a larger one gets fresh ids after
  the ones already handed out (ids stay unique over the run). docs/design/ledger.md says why this
  rather than refusing the override.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from miles_contracts import Sample
from miles_contracts.settings import SETTINGS_KEY

from miles.data.errors import DataError
from miles.data.row_settings import RowSettings, SettingsProblem
from miles.loop.ledger import Draw

INVALID_SETTINGS = "invalid_settings"


def check_redraws(draws: Sequence[Draw], settings: RowSettings, on_error: str) -> tuple[list[Draw], list[Draw]]:
    """``draws`` split into those whose prompt's settings pass the run's check (their metadata
    holding the freshly validated settings) and those that fail (``data.on_error: skip``); with
    ``fail``, raises :class:`DataError` naming every failing prompt and its problem."""
    valid: list[Draw] = []
    invalid: list[tuple[Draw, str]] = []
    for draw in draws:
        prompt: dict[str, Any] = copy.deepcopy(draw.prompt or {})
        metadata = dict(prompt.get("metadata") or {})
        fields = {SETTINGS_KEY: metadata.pop(SETTINGS_KEY)} if SETTINGS_KEY in metadata else {}
        try:
            checked = settings.check(fields, metadata)
        except SettingsProblem as problem:
            invalid.append((draw, str(problem)))
            continue
        prompt["metadata"] = {**metadata, **({SETTINGS_KEY: checked} if checked else {})}
        draw.prompt = prompt
        valid.append(draw)
    if invalid and on_error == "fail":
        listed = "; ".join(f"group {d.group} (epoch {d.epoch}, data index {d.data_index}): {why}" for d, why in invalid)
        raise DataError(f"{len(invalid)} prompt(s) the checkpoint holds to draw again fail this run's settings "
                        f"check: {listed}. Resume with the plugins and rewards the run had, or set data.on_error=skip "
                        f"to drop them (the ledger records them as dropped, {INVALID_SETTINGS})")
    return valid, [d for d, _ in invalid]


def resized(group: list[Sample], size: int, next_index: int) -> tuple[list[Sample], int]:
    """``group`` with ``size`` samples (the run's ``rollout.samples_per_prompt``); the next free
    sample index after the ids a larger group took."""
    if len(group) >= size:
        return group[:size], next_index
    grown = list(group)
    while len(grown) < size:
        sample = copy.deepcopy(group[0])
        sample.index = next_index
        next_index += 1
        grown.append(sample)
    return grown, next_index


__all__ = ["INVALID_SETTINGS", "check_redraws", "resized"]
