"""The mini-swe-agent row of ``miles bench conformance``: the unmodified harness (text-based, one
bash block per reply) against a session, its commands run in a sandbox service of this process.

The service starts on first use and lives as long as the process; its one template is a two-test
repository with a bug, written to a temporary folder. The run's token is the process's
(``MILES_RUN_TOKEN``) when there is one, else a fresh one that the harness's client is given too.
"""

from __future__ import annotations

import atexit
import tempfile
import threading
from pathlib import Path
from typing import Any

from miles_contracts.wire.auth import new_token, run_token
from miles_tito.conformance.rows import Episode, Row
from miles_tito.conformance.script import ToolScript

from miles_sandbox.config import SandboxLimits, SandboxSection
from miles_sandbox.server import SandboxServer
from miles_sandbox.swe.agent import SweEpisode, run_swe_episode
from miles_sandbox.swe.settings import SweAgentSettings

# The harness offers no tool API (it reads a bash block out of the reply's text): the turns are
# text, and now and then one that opens a call it cannot read.
TEXT = ToolScript("bash", {}, calls=0, malformed=1, period=3)
TEMPLATE = "adder"
TASK = "`add(2, 3)` in adder.py returns -1 instead of 5. Fix the bug; the tests in tests/ must pass."

_lock = threading.Lock()
_service: tuple[SandboxServer, str] | None = None


def write_template(root: Path) -> None:
    """The ``adder`` task under ``root``: a subtraction where an addition belongs, two tests (also the
    sandbox tests' template)."""
    task = root / TEMPLATE
    (task / "tests").mkdir(parents=True)
    (task / "adder.py").write_text("def add(a, b):\n    return a - b\n")
    (task / "tests" / "__init__.py").write_text("")
    (task / "tests" / "test_adder.py").write_text(
        "import unittest\nfrom adder import add\n\n\nclass AddTest(unittest.TestCase):\n"
        "    def test_small(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n")


def _sandbox() -> tuple[str, str]:
    """The service's URL and token, started on first use for the rest of the process."""
    global _service
    with _lock:
        if _service is None:
            templates = Path(tempfile.mkdtemp(prefix="miles-conformance-"))
            write_template(templates)
            token = run_token() or new_token()
            section = SandboxSection(templates_dir=str(templates), pool_size=2,
                                     limits=SandboxLimits(wall_s=10, workspace_mb=32))
            server = SandboxServer(section, token=token).__enter__()
            atexit.register(server.__exit__, None, None, None)
            _service = (server, token)
        server, token = _service
        return server.url, token


def rows() -> list[Row]:
    async def run(episode: Episode) -> dict[str, Any]:
        import asyncio

        url, token = _sandbox()
        swe = SweEpisode(task=TASK, template=TEMPLATE, settings=SweAgentSettings(tests=["tests"], n_tests=2),
                         step_limit=episode.max_turns, wall_time_s=120.0, command_timeout_s=10,
                         sampling={"max_tokens": episode.max_tokens})
        return await asyncio.to_thread(run_swe_episode, episode.base_url, episode.api_key, url, swe, token=token)

    # the harness re-sends its history without a reply it could not parse: a real fork, not a spurious one
    return [Row("mini-swe-agent", "chat", run, TEXT, allowed_forks=("rewrite",))]
