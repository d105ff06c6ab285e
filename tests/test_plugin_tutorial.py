"""docs/plugins/writing-a-plugin.md stays true: its files are the example package's files, its
excerpts are in the repository, the example package's own tests pass, and the config error it
shows is the one Miles prints. (The install steps and the import error it shows are checked in
tests/test_third_party_plugin.py, against a real install.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "plugins" / "writing-a-plugin.md"
EXAMPLE = ROOT / "docs" / "plugins" / "example-bridge"


def tutorial_blocks(kind: str) -> dict[str, str]:
    """``{argument: code}`` for every fenced block preceded by ``<!-- kind: argument -->``."""
    pattern = re.compile(rf"<!-- {kind}: (.+?) -->\n```[a-z]*\n(.*?)\n```", re.DOTALL)
    return {m.group(1): m.group(2) for m in pattern.finditer(TUTORIAL.read_text())}


def test_every_file_shown_is_the_example_packages_file() -> None:
    shown = tutorial_blocks("file")
    assert set(shown) == {"pyproject.toml", "src/acme_miles/plugin.py", "src/acme_miles/reward.py",
                          "src/acme_miles/bridge.py", "tests/test_acme.py"}
    for relative, code in shown.items():
        assert code == (EXAMPLE / relative).read_text().rstrip("\n"), f"{relative} in the tutorial differs from the file"


def test_every_excerpt_is_in_the_repository() -> None:
    excerpts = tutorial_blocks("from")
    assert excerpts
    for relative, code in excerpts.items():
        assert code in (ROOT / relative).read_text(), f"the excerpt of {relative} is no longer in it"


@pytest.mark.slow
def test_example_package_tests_pass() -> None:
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(EXAMPLE / "tests"), "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed" in result.stdout


def test_misspelled_config_key_message_is_the_one_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.config import build_config
    from miles.errors import ConfigError
    from miles.kernel import Kernel

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    from acme_miles import plugin

    kernel = Kernel.load()
    kernel.register_plugin(plugin, name="acme")
    try:
        with pytest.raises(ConfigError) as info:
            build_config({"reward": {"name": "concise"}, "concise": {"max_wrds": 30}}, kernel=kernel)
        assert str(info.value) == tutorial_blocks("output")["misspelled config key"]
        config = build_config({"reward": {"name": "concise"}, "concise": {"max_words": 30}}, kernel=kernel)
        assert config.section("concise", plugin.ConciseSection).max_words == 30
    finally:
        kernel.unregister_plugin("acme")
