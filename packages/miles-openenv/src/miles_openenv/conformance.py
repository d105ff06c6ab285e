"""The OpenEnv row of ``miles bench conformance``: the ``guess_number`` environment served by
openenv-core on loopback, played through the adapter's own agent."""

from __future__ import annotations

import threading
from typing import Any

from miles_tito.conformance.rows import Episode, Row
from miles_tito.conformance.script import ToolScript
from miles_tito.server.background import BackgroundServer

from miles_openenv.agent import OpenEnvAgent
from miles_openenv.guess_number import create_guess_number_app
from miles_openenv.section import OpenEnvSection

# text actions, no tools: the turns are guesses, and now and then an unreadable call
GUESSES = ToolScript("guess", {}, calls=0, malformed=1, period=3)

_server: BackgroundServer | None = None
_server_lock = threading.Lock()


def _environment_url() -> str:
    """The environment server, started on first use for the rest of the process."""
    global _server
    with _server_lock:
        if _server is None:
            _server = BackgroundServer(create_guess_number_app)
            _server.start()
        return _server.url


def rows() -> list[Row]:
    async def run(episode: Episode) -> dict[str, Any]:
        section = OpenEnvSection(url=_environment_url(), observation_field="prompt", max_steps=episode.max_turns,
                                 system_prompt="Play the game. Reply with one number.")
        metadata = {"api_key": episode.api_key, "openenv": {"seed": episode.index}}
        prompt = [{"role": "system", "content": section.system_prompt}]
        return await OpenEnvAgent(section)(episode.base_url, prompt, {"max_tokens": episode.max_tokens}, metadata)

    return [Row("OpenEnv guess_number", "chat", run, GUESSES)]
