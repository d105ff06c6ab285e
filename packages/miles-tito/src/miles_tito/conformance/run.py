"""Running the conformance rows: one engine, a session server per row (its chat family reads turns
by the row's script), ``episodes`` episodes per row, each checked from the session's final view."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.session import SessionView, TurnRecord

from miles_tito.conformance.check import EpisodeCheck, check_episode
from miles_tito.conformance.rows import Episode, Row
from miles_tito.server.background import BackgroundServer
from miles_tito.server.factory import app_factory
from miles_tito.tokenizer import TitoTokenizer


@dataclass(slots=True)
class RowResult:
    """A row's totals over its episodes; ``failed``: episodes whose harness raised (with why)."""

    harness: str
    api: str
    family: str
    episodes: int = 0
    check: EpisodeCheck = field(default_factory=EpisodeCheck)
    failed: list[str] = field(default_factory=list)

    @property
    def token_exact_pct(self) -> float:
        return 100.0 * self.check.token_exact / self.check.turns if self.check.turns else 0.0

    @property
    def conforms(self) -> bool:
        return (self.check.turns > 0 and self.check.token_exact == self.check.turns and not self.failed
                and self.check.spurious_forks == 0 and self.check.silently_dropped == 0)

    def to_dict(self) -> dict[str, Any]:
        c = self.check
        return {"harness": self.harness, "api": self.api, "family": self.family, "episodes": self.episodes,
                "turns": c.turns, "token_exact_pct": round(self.token_exact_pct, 2), "spurious_forks": c.spurious_forks,
                "tool_calls": c.tool_calls, "malformed_kept": c.malformed, "silently_dropped": c.silently_dropped,
                "failed_episodes": self.failed, "problems": c.problems[:20], "conforms": self.conforms}


def run_row(row: Row, engine_url: str, tito: TitoTokenizer, *, episodes: int, max_turns: int, max_tokens: int,
            max_context_len: int = 4096) -> RowResult:
    """``episodes`` episodes of ``row`` against a session server of its own in front of ``engine_url``."""
    family = row.script.family(tito.family) if row.script is not None else tito.family
    scripted = TitoTokenizer(tito.tokenizer, family)
    result = RowResult(row.harness, row.api, tito.family.name)
    make = app_factory(engine_url, scripted, model_name="policy", max_context_len=max_context_len,
                       default_max_tokens=max_tokens)
    with BackgroundServer(make) as server:
        for index in range(episodes):
            view, error = asyncio.run(_episode(server.url, row, index, max_turns, max_tokens))
            result.episodes += 1
            if error is not None:
                result.failed.append(f"episode {index}: {error}")
            if view is not None:
                result.check.add(check_episode(view, row.script, lambda r: turn_text(scripted, r), row.allowed_forks))
    return result


def turn_text(tito: TitoTokenizer, record: TurnRecord) -> str:
    """The text the chat family parsed for ``record`` (no stop strings are set in conformance runs)."""
    ids = record.output_ids
    if ids and ids[-1] in tito.stop_token_ids:
        ids = ids[:-1]
    return tito.decode(ids)


async def _episode(server: str, row: Row, index: int, max_turns: int, max_tokens: int) -> tuple[SessionView | None, str | None]:
    async with httpx.AsyncClient(base_url=server, headers=auth_headers(), timeout=600, trust_env=False) as http:
        created = (await http.post("/sessions", json={"sampling": {"temperature": 1.0, "seed": index}})).json()
        error = None
        try:
            await row.run(Episode(created["base_url"], created["api_key"], index, max_turns, max_tokens))
        except Exception as exc:  # a harness that fails is reported in the row, the table goes on
            error = f"{type(exc).__name__}: {exc}"
        answer = await http.delete(f"/sessions/{created['session_id']}")
        if answer.status_code != 200:
            lost = f"collecting the session failed: {answer.status_code} {answer.text[:200]}"
            return None, f"{error}; {lost}" if error else lost
        return SessionView.model_validate(answer.json()), error
