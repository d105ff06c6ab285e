"""What ``miles train --resume RUN_DIR`` takes from the run folder's ``config.yaml``.

A run folder may come from anyone (a colleague's share, a downloaded example run, a folder on a
shared disk), and resuming runs what its config says. Most settings only shape the training
(learning rate, steps, model); a few decide what code runs or where the run's secrets go: the
fields marked :class:`~miles.sections.Privileged` by the section that declares them
(``sglang.python``, ``sglang.env``, ...). Those are taken from the folder only if

* the value is the field's default, which is what this command line gives without the folder, or
* the command line gives the whole setting again (``sglang.python=/opt/sglang/bin/python``), or
* the user passes ``--trust-run-config``.

Anything else stops the resume before a process starts, with every such setting, its value in
the folder and the command line that accepts it.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from miles.cli.section_args import config_override
from miles.config import MilesConfig
from miles.errors import MilesError
from miles.sections import CORE_SECTIONS, Privileged

TRUST_FLAG = "--trust-run-config"


@dataclass(frozen=True, slots=True)
class FolderSetting:
    """A privileged setting whose value came from the run folder."""

    key: str  # section.field
    value: Any
    what: str  # what it decides (the field's Privileged marker)


def privileged_fields(model: type[BaseModel]) -> dict[str, Privileged]:
    """The fields of a section's model that carry a :class:`Privileged` marker, by name."""
    found = {}
    for name, info in model.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, Privileged)]
        if marks:
            found[name] = marks[0]
    return found


def _sections(config: MilesConfig) -> Iterator[tuple[str, BaseModel]]:
    for name in CORE_SECTIONS:
        yield name, getattr(config, name)
    yield from sorted(config.extra.items())


def settings_from_folder(config: MilesConfig, overrides: Sequence[str]) -> list[FolderSetting]:
    """The privileged settings of ``config`` (the folder's config with ``overrides`` applied) that
    neither the command line gives whole nor equal their default."""
    given = [item.partition("=")[0] for item in overrides]
    found = []
    for section_name, section in _sections(config):
        fields = type(section).model_fields
        for name, mark in privileged_fields(type(section)).items():
            key = f"{section_name}.{name}"
            value = getattr(section, name)
            whole = any(key == g or key.startswith(g + ".") for g in given)  # the field, or its section, given
            if whole or value == fields[name].get_default(call_default_factory=True):
                continue
            found.append(FolderSetting(key, section.model_dump(mode="json", include={name})[name], mark.what))
    return found


def refuse_folder_privileges(config: MilesConfig, overrides: Sequence[str], run_dir: Path, *,
                             command: str = "miles train --resume") -> None:
    """Raise :class:`MilesError` naming every privileged setting ``config`` takes from ``run_dir``
    alone (see the module's docstring); ``command``: the command line that reads the folder."""
    taken = settings_from_folder(config, overrides)
    if not taken:
        return
    lines = "\n".join(f"  - {config_override(s.key, s.value).replace('=', ': ', 1)}   ({s.what})" for s in taken)
    again = " ".join(shlex.quote(arg) for arg in (*overrides, *(config_override(s.key, s.value) for s in taken)))
    raise MilesError(
        f"{run_dir}/config.yaml sets {len(taken)} setting(s) that decide what runs or where the run's secrets go, "
        f"and this command line does not give them:\n{lines}\n"
        f"A run folder can come from anyone, so `{command}` does not take these from it alone. If they are what "
        f"you want, give them on the command line:\n"
        f"  {command} {shlex.quote(str(run_dir))} {again}\n"
        f"or pass {TRUST_FLAG} to take the folder's whole config (only for a folder you wrote)."
    )
