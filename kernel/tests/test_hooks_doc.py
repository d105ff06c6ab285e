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


FIELDS = ("Runs in", "Spec", "Built-in", "Tests")
ROOT = DOC.parents[2]


def _sections() -> dict[str, str]:
    """Each hook section's text, by its heading."""
    parts = re.split(r"^### `([^`]+)`\s*$", DOC.read_text(), flags=re.M)
    return {heading: body.split("\n## ")[0] for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_hook_says_where_it_runs_its_spec_its_built_in_and_its_tests() -> None:
    incomplete = {heading: [f for f in FIELDS if f"- **{f}**:" not in body]
                  for heading, body in _sections().items() if heading.startswith("miles_")}
    incomplete = {heading: lacking for heading, lacking in incomplete.items() if lacking}
    assert not incomplete, f"hook sections of {DOC} without these lines: {incomplete}"


def test_the_paths_the_sections_name_exist() -> None:
    named = {path for body in _sections().values()
             for line in body.splitlines() if line.startswith(("- **Built-in**:", "- **Tests**:"))
             for path in re.findall(r"`([\w./-]+\.py)`", line)}
    assert named, "no paths found: the section format changed"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"{DOC} names files that do not exist: {missing}"


def test_every_spec_docstring_says_where_the_hook_runs() -> None:
    silent = [name for name in _specs() if "**Runs in**" not in (getattr(hookspecs, name).__doc__ or "")]
    assert not silent, f"hook specs that do not say where they run: {silent}"
