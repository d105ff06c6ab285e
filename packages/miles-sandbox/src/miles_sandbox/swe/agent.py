"""The Miles agent ``mini_swe_agent``: the unmodified mini-swe-agent harness (``DefaultAgent``,
``LitellmTextbasedModel`` and its stock ``default.yaml`` prompts) with its model pointed at the
episode's session (an OpenAI-compatible endpoint, through litellm's ``openai/`` provider) and its
commands run in a sandbox leased from the run's sandbox service for the episode.

:func:`run_swe_episode` is the whole episode, synchronous (the harness is): lease, run, score,
give back. The agent runs it on a worker thread; the episode's wall-clock budget is also the
harness's own ``wall_time_limit_seconds`` so that the thread ends soon after the generator gives up.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# before litellm and mini-swe-agent are imported: no start-up banner, no download of litellm's
# price list (no network in CI), no cost accounting (a local policy has no price), and no retry of
# a refused turn (the session server's 4xx are final: an episode limit, a broken history)
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

import yaml  # noqa: E402
from miles_contracts import RunContext  # noqa: E402
from miles_contracts.settings import SampleSettings  # noqa: E402

from miles_sandbox.client import SandboxClient  # noqa: E402
from miles_sandbox.service import SANDBOX  # noqa: E402
from miles_sandbox.swe.reward import run_tests  # noqa: E402
from miles_sandbox.swe.settings import SweAgentSettings  # noqa: E402

AgentFn = Callable[[str, Any, dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any]]]
_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop")


@dataclass
class SweEpisode:
    """One task for :func:`run_swe_episode`.

    :ivar task: the issue text (mini-swe-agent's ``{{task}}``).
    :ivar template: the sandbox template (the task's repository).
    :ivar settings: how its tests run.
    :ivar step_limit: model calls at most.
    :ivar wall_time_s: the harness stops starting steps after this long.
    :ivar command_timeout_s: one command's time limit.
    :ivar sampling: OpenAI sampling keyword arguments for every model call.
    """

    task: str
    template: str | None
    settings: SweAgentSettings = field(default_factory=SweAgentSettings)
    step_limit: int = 8
    wall_time_s: float = 600.0
    command_timeout_s: int = 30
    sampling: dict[str, Any] = field(default_factory=dict)


def stock_config() -> dict[str, Any]:
    """mini-swe-agent's own ``default.yaml`` (the text-based harness: one bash block per reply)."""
    import minisweagent

    return dict(yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "default.yaml").read_text()))


def run_swe_episode(model_url: str, api_key: str, sandbox_url: str, episode: SweEpisode, *,
                    token: str | None = None) -> dict[str, Any]:
    """Run mini-swe-agent on ``episode`` against the OpenAI endpoint ``model_url`` (a session's
    ``.../v1``) with commands in a sandbox of ``sandbox_url``; then run the task's tests there.
    ``token`` is the sandbox service's (default: the run's). Returns the harness's exit status and
    submission, its model calls and the test result."""
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    # litellm prints its provider list on every exception it maps, and pricing a local policy is
    # one (ignored above): 1,851 such lines in a 20-step H200 run's log, nothing else changed
    litellm.suppress_debug_info = True

    from miles_sandbox.swe.environment import SandboxEnvironment

    config = stock_config()
    model_kwargs = {**config["model"].get("model_kwargs", {}), "api_base": model_url, "api_key": api_key,
                    **{k: v for k, v in episode.sampling.items() if k in _SAMPLING_KEYS}}
    model = LitellmTextbasedModel(**{**config["model"], "model_name": "openai/policy", "model_kwargs": model_kwargs,
                                     "cost_tracking": "ignore_errors"})
    client = SandboxClient(sandbox_url, token=token, timeout_s=float(episode.command_timeout_s) + 60.0)
    try:
        with client.lease(episode.template) as lease:
            environment = SandboxEnvironment(lease, **{**config.get("environment", {}), "timeout": episode.command_timeout_s})
            agent = DefaultAgent(model, environment, **{**config["agent"], "step_limit": episode.step_limit,
                                                         "cost_limit": 0.0,
                                                         "wall_time_limit_seconds": int(episode.wall_time_s)})
            try:
                outcome = agent.run(episode.task)
            except Exception as exc:  # the harness re-raises what it did not expect, after recording it
                outcome = {"exit_status": type(exc).__name__, "submission": "", "exception_str": str(exc)[:2000]}
            tests = run_tests(lease, episode.settings)
    finally:
        client.close()
    return {"exit_status": outcome.get("exit_status"), "submission": str(outcome.get("submission", ""))[:4000],
            **({"exception": outcome["exception_str"]} if outcome.get("exception_str") else {}),
            "model_calls": agent.n_calls, "messages": len(agent.messages), "tests": tests}


def bind(ctx: RunContext) -> AgentFn:
    """The agent for this run (``AgentSpec.bind``, in the driver): the sandbox is the run's service."""
    return swe_agent(None, max_turns=ctx.config.rollout.max_turns, wall_s=ctx.config.rollout.agent_timeout)


def swe_agent(sandbox_url: str | None, *, max_turns: int = 8, wall_s: float = 600.0) -> AgentFn:
    """``run_agent(base_url, prompt, request_kwargs, metadata)`` running :func:`run_swe_episode`:
    the sandbox at ``sandbox_url``, else the run's (``metadata["services"]["sandbox"]``); the task
    from the row's settings in ``metadata["settings"]`` (``env.workspace``, ``agent``). Outside a run
    (a conformance suite, a test) give ``sandbox_url`` and call it as any agent."""

    async def run_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                        metadata: dict[str, Any]) -> dict[str, Any]:
        urls = [sandbox_url] if sandbox_url else (metadata.get("services") or {}).get(SANDBOX) or []
        if not urls:
            raise RuntimeError("mini_swe_agent needs the run's sandbox service (role 'sandbox'), and none was given")
        row = SampleSettings.model_validate(metadata.get("settings") or {})
        settings = SweAgentSettings.model_validate(row.agent)
        limits = metadata.get("limits") or {}
        episode = SweEpisode(
            task=_task_text(prompt), template=row.env.workspace, settings=settings,
            step_limit=settings.step_limit or int(metadata.get("max_turns") or max_turns),
            wall_time_s=float(limits.get("wall_clock_s") or wall_s),
            command_timeout_s=int(limits.get("tool_timeout_s") or 30), sampling=dict(request_kwargs),
        )
        return await asyncio.to_thread(run_swe_episode, base_url, metadata["api_key"], urls[0], episode)

    return run_agent


def _task_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m.get("content") or "") for m in prompt if m.get("role") == "user")
