"""Every shipped config validates, and starts with the command that runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in [*ROOT.glob("examples/**/*.yaml"), *ROOT.glob("scripts/**/*.yaml")])


def test_there_are_example_configs() -> None:
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_validates_and_names_its_command(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # configs refer to data files relative to the repository root
    first = path.read_text().splitlines()[0]
    assert first.startswith("# uv run miles train "), f"{path} must start with the command that runs it"
    assert str(path.relative_to(ROOT)) in first
    load_config(path)
