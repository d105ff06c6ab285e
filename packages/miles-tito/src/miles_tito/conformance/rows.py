"""The rows of the conformance table: which harness, over which wire API, reading turns how.

Adapter packages contribute their rows through a module with ``rows() -> list[Row]`` (imported only
when the table runs); a row whose package is not installed is reported as missing, never skipped
silently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import import_module

from miles_tito.conformance.agents import chat_agent, messages_agent, responses_agent
from miles_tito.conformance.script import ToolScript


@dataclass(frozen=True, slots=True)
class Episode:
    """What a row's episode gets: its session (``base_url`` ``.../sessions/<id>/v1`` and key), its
    number in the row, and the bounds every row shares."""

    base_url: str
    api_key: str
    index: int
    max_turns: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Row:
    """One harness over one wire API.

    :ivar harness: what drives the episode (an SDK agent, an environment library's rollout).
    :ivar api: the wire API its model calls use: ``chat``, ``messages`` or ``responses``.
    :ivar run: runs one episode in the given session.
    :ivar script: how the server reads the tiny model's turns (the tool the harness offers).
    :ivar allowed_forks: fork causes the harness really produces (``root`` and ``subagent`` always are).
    """

    harness: str
    api: str
    run: Callable[[Episode], Awaitable[object]]
    script: ToolScript | None
    allowed_forks: tuple[str, ...] = ()


CALCULATOR = ToolScript("calculator", {"expression": "6 * 7"})
QUESTION = "What is 6 * 7?"


def _sdk_row(api: str, agent: Callable[..., Awaitable[int]]) -> Row:
    async def run(episode: Episode) -> int:
        return await agent(episode.base_url, episode.api_key, QUESTION, episode.max_turns, episode.max_tokens)

    return Row(f"{api} SDK agent", api, run, CALCULATOR)


def builtin_rows() -> list[Row]:
    """The SDK agents of miles-tito itself, one per wire API."""
    return [_sdk_row("chat", chat_agent), _sdk_row("messages", messages_agent), _sdk_row("responses", responses_agent)]


ADAPTER_ROWS: dict[str, str] = {
    "verifiers": "miles_verifiers.conformance",
    "openenv": "miles_openenv.conformance",
    # The mini-swe-agent adapter (miles-sandbox) plugs in here: a module with rows() -> list[Row]
    # whose episode runs the unmodified harness in a session (its commands in the sandbox).
    "mini-swe-agent": "miles_sandbox.conformance",
}
"""Adapter name -> module with ``rows() -> list[Row]``."""


def adapter_rows(names: list[str] | None = None) -> tuple[list[Row], dict[str, str]]:
    """The rows of the named adapters (all by default) and, by adapter, why one has none."""
    rows: list[Row] = []
    missing: dict[str, str] = {}
    for name, module in ADAPTER_ROWS.items():
        if names is not None and name not in names:
            continue
        try:
            found = import_module(module)
        except ModuleNotFoundError as exc:
            missing[name] = f"{module} is not installed ({exc})"
            continue
        rows += found.rows()
    return rows, missing
