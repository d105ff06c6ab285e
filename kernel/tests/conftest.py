"""Fixtures for kernel tests: plugin modules written to disk and exposed as entry points."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path

import pytest
from miles import plugins
from miles.kernel import Kernel


@pytest.fixture
def fresh_kernels() -> Iterator[None]:
    Kernel.clear_cache()
    yield
    Kernel.clear_cache()


@pytest.fixture
def extra_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_kernels: None) -> Callable[[str, str], None]:
    """``add(name, source)`` writes a module and adds entry point ``name`` for it to the installed ones."""
    root = tmp_path / "plugin_modules"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    added: list[metadata.EntryPoint] = []
    installed = plugins._entry_points

    def entry_points() -> list[metadata.EntryPoint]:
        return sorted([*installed(), *added], key=lambda ep: ep.name)

    monkeypatch.setattr(plugins, "_entry_points", entry_points)

    def add(name: str, source: str) -> None:
        module = f"testplugin_{name}_{len(added)}"
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        added.append(metadata.EntryPoint(name=name, value=module, group=plugins.ENTRY_POINT_GROUP))

    yield add
    for ep in added:
        sys.modules.pop(ep.value, None)
