"""Plugin ``tito`` (distribution miles-tito): generators, the calculator tool, the ``session``
service, the ``tito`` config section and the ``serve session``, ``verify-template``, ``bench
session``, ``bench isolation``, ``bench episode-tokens``, ``bench conformance`` and ``bench tito`` commands.

Light on purpose: ``miles plugins`` imports this module, so FastAPI, transformers and the
generators load only when used.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import (
    CommandSpec,
    ConfigSectionSpec,
    GenerateContext,
    GeneratorSpec,
    RunContext,
    Sample,
    ServiceSpec,
    ToolSpec,
)
from miles_contracts.cluster import SESSION

from miles_tito.calculator import Calculator


def _lazy(module: str, attribute: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        from importlib import import_module

        return getattr(import_module(module), attribute)(*args, **kwargs)

    return call


class _LazyGenerator:
    """Defers importing a generator (and what it imports) to its first call."""

    def __init__(self, module: str, cls: str) -> None:
        self._module, self._cls = module, cls
        self._instance: Any = None

    async def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample:
        if self._instance is None:
            from importlib import import_module

            self._instance = getattr(import_module(self._module), self._cls)()
        result: Sample = await self._instance(sample, ctx)
        return result


@hookimpl
def miles_register_generators(register: Register[GeneratorSpec]) -> None:
    register("multi_turn", GeneratorSpec(_LazyGenerator("miles_tito.generators.multi_turn", "MultiTurnGenerator")))
    # the session server (registered below) records the agent's turns token-exact
    register("agentic", GeneratorSpec(_LazyGenerator("miles_tito.generators.agentic", "AgenticGenerator"),
                                      services=(SESSION,), needs_agent=True))


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_tito.server.launch import SESSION_SERVICE

    register("session", SESSION_SERVICE)


@hookimpl
def miles_register_tools(register: Register[ToolSpec]) -> None:
    register("calculator", ToolSpec(Calculator()))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_tito.config import TitoSection

    register("tito", ConfigSectionSpec(TitoSection))


def _command(module: str, help: str, description: str | None = None, *, uses_context: bool = False) -> CommandSpec:
    """A command whose ``add_arguments`` / ``run`` live in ``module`` (imported when used); with
    ``uses_context`` its ``run`` gets the CLI's run context too (its kernel's chat families)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _lazy(module, "add_arguments")(parser)

    def run(args: argparse.Namespace, ctx: RunContext) -> int:
        code: int = _lazy(module, "run")(args, ctx) if uses_context else _lazy(module, "run")(args)
        return code

    return CommandSpec(help, run, add_arguments=add_arguments, description=description)


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("serve session", _command(
        "miles_tito.server.cli",
        "session server: OpenAI-compatible chat per session, token-exact records (TITO)",
        "Serve POST /sessions, /sessions/{id}/v1/chat/completions, GET/DELETE /sessions/{id} in front of a router.",
    ))
    register("verify-template", _command(
        "miles_tito.verify.cli",
        "check where a chat template breaks prefix invariance (exit 1 on a break)",
        "Render canned conversations (tools, parallel calls, thinking, retries, system messages) at every "
        "split point after an assistant turn and report where appending messages re-renders history.",
        uses_context=True,
    ))
    register("bench session", _command(
        "miles_tito.bench.session",
        "latency the session server adds over calling the engine directly, and requests/s",
    ))
    register("bench isolation", _command(
        "miles_tito.bench.isolation",
        "latency of other sessions and engine requests while one huge request is in flight, against a baseline",
    ))
    register("bench episode-tokens", _command(
        "miles_tito.bench.episode_tokens",
        "tokens a trainer sees per generated token on a compacting, delegating agent episode: graph vs rows vs per request",
        uses_context=True,
    ))
    register("bench conformance", _command(
        "miles_tito.conformance.cli",
        "every harness x wire API x chat family on a real engine: share of turns token-exact, spurious forks, dropped tool calls",
        "Runs episodes of each SDK agent (Chat, Messages, Responses) and each installed adapter (verifiers, OpenEnv, "
        "mini-swe-agent) against a session server and checks what it recorded; exit 1 when a row does not conform.",
        uses_context=True,
    ))
    register("bench tito", _command(
        "miles_tito.bench.tito",
        "incremental TITO tokenization vs re-rendering and re-tokenizing the whole history every turn",
        uses_context=True,
    ))
