"""The ``agentic`` generator: run a user's agent against a session, keep its exact tokens.

Per sample: open a session on the session server, call the registered agent
``run_agent(base_url, prompt, request_kwargs, metadata)`` under the episode's wall-clock budget
(``rollout.agent_timeout``, or the row's ``settings.budget.wall_clock_s``), then --
always, whatever the agent did -- delete the session, which returns its records, and assemble them
into the trajectory sample.

* ``base_url`` is the session's OpenAI base URL (``.../sessions/<id>/v1``); ``metadata["api_key"]`` is
  the session's key, which reaches that session only: ``AsyncOpenAI(base_url=base_url,
  api_key=metadata["api_key"])`` is all an agent needs (the session server refuses requests without it).
* ``prompt`` is the sample's prompt as OpenAI messages; the agent re-sends the whole history each turn.
* ``request_kwargs`` are the run's sampling settings in OpenAI names (``max_tokens``, ``temperature``,
  ``top_p``, ``stop``, ``seed``; ``extra_body`` for ``top_k``); the session also uses them as defaults,
  so an agent that ignores them still samples as the run says.
* ``metadata`` is the sample's metadata plus ``session_id``, ``api_key``, ``index``, ``group_index``,
  ``max_context_len``, ``max_turns`` (``rollout.max_turns`` or the row's) and ``limits`` (every
  limit of the episode, the row's budget over the run's:
  :class:`~miles_tito.generators.settings.Limits`) and ``services`` (the run's service URLs by role,
  e.g. the ``sandbox`` an agent's spec asked for); the row's validated settings, when it has
  some, are ``metadata["settings"]`` (``env``: task id, workspace, tools; ``agent``: the agent's own,
  validated by its ``settings_model``). The agent's return value is kept in ``sample.metadata["agent_result"]``.
* the row's token budget (``settings.budget.tokens``) is the session's ``max_episode_tokens``: the
  session server refuses the turn that would go over it (``400 episode_limit``).

The run's engine captures (``ctx.captures``) are given to the session when it is created; every
turn's payloads come back in the records and are stitched into the sample's stash.

An agent that raises or runs out of time costs its sample (ABORTED, exit reason ``agent_exception``
/ ``wall_clock_budget``), never the run; so does a session server that cannot be reached
(``engine_error``). An episode over its token budget is TRUNCATED (``token_budget``) and trained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import httpx
from miles_contracts import EngineCapture, ExitReason, GenerateContext, Sample, Status
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import SessionView

from miles_tito.assembly import AssemblyError, attach_captures, branch_sample
from miles_tito.generators.settings import GeneratorSettings, prompt_messages, settings_from
from miles_tito.server.background import BackgroundServer
from miles_tito.server.cli import episode_limits
from miles_tito.tokenizer import TitoTokenizer


class AgenticGenerator:
    """A :class:`miles_contracts.Generator`."""

    def __init__(self) -> None:
        self._embedded: dict[tuple[str, int, str, bool], BackgroundServer] = {}
        self._embedded_lock = threading.Lock()

    async def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample:
        settings = settings_from(ctx, sample, need_agent=True)
        limits = settings.limits
        server_url = settings.tito.session_server_url or ctx.session_server_url or self._embedded_server(ctx, settings)
        sampling = request_kwargs(ctx.sampling_params)
        # the run's token goes to the session server only, never through an HTTP_PROXY (miles.loopback)
        async with httpx.AsyncClient(base_url=server_url, timeout=settings.tito.collect_timeout,
                                     headers=auth_headers(), trust_env=False) as http:
            try:
                created = await http.post("/sessions", json={
                    "metadata": sample.metadata, "sampling": session_sampling(ctx.sampling_params),
                    "captures": [c.spec.model_dump() for c in ctx.captures], "role": settings.tito.agent_role,
                    **({"max_episode_tokens": limits.tokens} if limits.tokens < settings.tito.max_tokens_per_episode else {}),
                })
                created.raise_for_status()
            except (httpx.HTTPError, TypeError, ValueError) as exc:
                return sample.finish(Status.ABORTED, ExitReason.ENGINE_ERROR, f"cannot open a session on {server_url}: {exc}")
            session = created.json()
            metadata = {
                **sample.metadata, "session_id": session["session_id"], "api_key": session.get("api_key"),
                "index": sample.index,
                "group_index": sample.group_index, "max_context_len": ctx.max_context_len, "max_turns": limits.max_turns,
                "limits": limits.to_dict(), "services": {role: list(urls) for role, urls in ctx.service_urls.items()},
            }
            outcome: tuple[Status, ExitReason, str] | None = None
            try:
                result = await asyncio.wait_for(
                    settings.agent(session["base_url"], prompt_messages(sample.prompt), sampling, metadata),  # type: ignore[misc]
                    timeout=limits.wall_clock_s,
                )
                if result is not None:
                    sample.metadata["agent_result"] = result
            except TimeoutError:
                outcome = (Status.ABORTED, ExitReason.WALL_CLOCK_BUDGET, f"the agent did not finish within "
                           f"{limits.wall_clock_s:g}s (rollout.agent_timeout or the row's settings.budget.wall_clock_s)")
            except Exception as exc:
                outcome = (Status.ABORTED, ExitReason.AGENT_EXCEPTION, f"the agent raised {type(exc).__name__}: {exc}")
            finally:
                view = await _collect(http, session["session_id"])
        return _finish(sample, view, outcome, ctx.captures, train_retried=settings.tito.train_retried)

    def _embedded_server(self, ctx: GenerateContext, settings: GeneratorSettings) -> str:
        """A session server in this process, one per engine URL, tokenizer and family."""
        engine_url = ctx.engine.base_url
        if not engine_url:
            raise RuntimeError(
                "the agentic generator needs a session server: set tito.session_server_url, start the run's "
                "session server (miles serve session), or give it an HTTP engine client"
            )
        key = (engine_url, id(ctx.tokenizer), settings.family.name, ctx.partial_rollout)
        with self._embedded_lock:
            server = self._embedded.get(key)
            if server is None:
                from miles_tito.server.factory import app_factory

                tito = TitoTokenizer(ctx.tokenizer, settings.family, render_check=settings.tito.render_check)
                make = app_factory(
                    engine_url, tito, model_name=str(getattr(ctx.tokenizer, "name_or_path", "model")),
                    max_context_len=ctx.max_context_len, default_max_tokens=ctx.sampling_params.max_new_tokens,
                    episode_limits=episode_limits(settings.tito),
                    idle_timeout=settings.tito.session_idle_timeout or None, partial_rollout=ctx.partial_rollout,
                )
                server = self._embedded[key] = BackgroundServer(make)
                server.start()
            return server.url

    def close(self) -> None:
        for server in self._embedded.values():
            server.stop()
        self._embedded.clear()


def request_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """The run's sampling as ``chat.completions.create`` keyword arguments."""
    kwargs: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.stop_strings:
        kwargs["stop"] = sampling.stop_strings
    if sampling.sampling_seed is not None:
        kwargs["seed"] = sampling.sampling_seed
    if sampling.top_k != -1:
        kwargs["extra_body"] = {"top_k": sampling.top_k}
    return kwargs


def session_sampling(sampling: SamplingParams) -> dict[str, Any]:
    """The same settings as session defaults (:class:`SessionSampling`)."""
    out: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k != -1:
        out["top_k"] = sampling.top_k
    if sampling.stop_strings:
        out["stop"] = sampling.stop_strings
    if sampling.sampling_seed is not None:
        out["seed"] = sampling.sampling_seed
    return out


async def _collect(http: httpx.AsyncClient, session_id: str) -> SessionView | str:
    """Delete the session and return its final state (or why that failed)."""
    try:
        response = await http.delete(f"/sessions/{session_id}")
        response.raise_for_status()
        return SessionView.model_validate(response.json())
    except (httpx.HTTPError, ValueError) as exc:
        return f"could not collect session {session_id}: {type(exc).__name__}: {exc}"


def _finish(
    sample: Sample, view: SessionView | str, outcome: tuple[Status, ExitReason, str] | None,
    captures: Sequence[EngineCapture], *, train_retried: bool = False,
) -> Sample:
    if isinstance(view, str):
        return sample.finish(Status.ABORTED, ExitReason.ENGINE_ERROR, view if outcome is None else f"{outcome[2]}; {view}")
    try:
        rows = episode_rows(sample, view, captures, train_retried=train_retried)
    except AssemblyError as exc:
        return sample.finish(Status.FAILED, None, f"the session's turns do not form one trajectory: {exc}")
    if view.failures:
        sample.metadata["session_failures"] = [f.model_dump() for f in view.failures]
    if view.failures_dropped:
        sample.metadata["session_failures_dropped"] = view.failures_dropped
    if view.episode_limit is not None:
        reason = ExitReason.TOKEN_BUDGET if view.episode_limit_kind == "tokens" else ExitReason.EPISODE_LIMIT
        # over a limit with nothing generated: there is no truncated response to train on
        return sample.finish(Status.TRUNCATED if rows else Status.ABORTED, reason, view.episode_limit)
    if outcome is not None:
        return sample.finish(*outcome)
    if not rows:
        return sample.finish(Status.ABORTED, ExitReason.NO_MODEL_CALL, "the agent finished without a single model call")
    return sample


def episode_rows(sample: Sample, view: SessionView, captures: Sequence[EngineCapture], *,
                 train_retried: bool = False) -> list[Sample]:
    """Fill ``sample`` with the episode's primary branch (the one the first session's last turn is
    on) and ``sample.branches`` with every other branch that has a trained turn, from the sessions'
    final views (the first session's, its ``children``); returns the rows, primary first.
    ``sample.metadata["episode"]`` says what the graph held (see docs/design/trajectories.md)."""
    sessions = [view, *view.children]
    primary = view.records[view.head_turn].branch if view.head_turn is not None else None
    ordered = sorted(((s, b) for s in sessions for b in s.branches),
                     key=lambda item: (item[0] is not view or item[1].branch_id != primary, item[1].branch_id))
    rows: list[Sample] = []
    for session, branch in ordered:
        last = max(r.turn for r in session.records if r.branch == branch.branch_id)
        path = session.path(last)
        into = sample if not rows else Sample(prompt=sample.prompt, label=sample.label,
                                              metadata={"episode_id": view.episode_id})
        row = branch_sample(path, dataclasses.replace(branch),
                            max_trim_tokens=view.max_trim_tokens, train_retried=train_retried, into=into)
        if row is None:
            continue
        rows.append(attach_captures(path, row, captures))
    if rows:
        head = view.active_records
        sample.response = str(head[-1].message.get("content") or "") if head else ""
        sample.metadata["messages"] = view.messages
        sample.branches = rows[1:]
    sample.metadata["episode"] = {
        "episode_id": view.episode_id, "sessions": len(sessions), "branches": sum(len(s.branches) for s in sessions),
        "rows": len(rows), "forks": dict(view.forks), "roles": sorted({s.role for s in sessions}),
        **({"limit": view.episode_limit} if view.episode_limit else {}),
    }
    return rows
