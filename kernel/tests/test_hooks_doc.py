"""docs/plugins/hooks.md documents every hook under a heading that is its exact signature."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from miles import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins" / "hooks.md"


def _specs() -> dict[str, str]:
    out = {}
    for name, fn in vars(hookspecs).items():
        if name.startswith("miles_") and callable(fn):
            params = ", ".join(inspect.signature(fn).parameters)
            out[name] = f"{name}({params})"
    return out


def test_every_hook_has_a_section_headed_by_its_signature() -> None:
    headings = set(re.findall(r"^### `([^`]+)`\s*$", DOC.read_text(), flags=re.M))
    missing = sorted(sig for sig in _specs().values() if sig not in headings)
    assert not missing, f"document these hooks in {DOC} with a '### `signature`' heading: {missing}"


def test_no_section_documents_a_hook_that_does_not_exist() -> None:
    headings = set(re.findall(r"^### `(miles_[^`]+)`\s*$", DOC.read_text(), flags=re.M))
    stale = sorted(headings - set(_specs().values()))
    assert not stale, f"hooks.md documents hooks that are not in hookspecs.py: {stale}"


def test_every_spec_has_a_docstring() -> None:
    undocumented = [name for name in _specs() if not (getattr(hookspecs, name).__doc__ or "").strip()]
    assert not undocumented
