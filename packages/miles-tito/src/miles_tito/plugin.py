"""Plugin ``tito`` (distribution miles-tito): generators, the calculator tool, the ``session``
service, the ``tito`` config section and the ``serve session``, ``verify-template``, ``bench
session`` and ``bench tito`` commands.

Light on purpose: ``miles plugins`` imports this module, so FastAPI, transformers and the
generators load only when used.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from miles import hookimpl
from miles.cli import Command
from miles.registry import Register
from miles_contracts.cluster import SESSION

from miles_tito.calculator import Calculator


def _lazy(module: str, attribute: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        from importlib import import_module

        return getattr(import_module(module), attribute)(*args, **kwargs)

    return call


class _LazyGenerator:
    """Defers importing a generator (and what it imports) to its first call.

    ``services`` are the roles of services a run using it must start (``session``: the session
    server, which this package registers too).
    """

    def __init__(self, module: str, cls: str, services: tuple[str, ...] = ()) -> None:
        self._module, self._cls = module, cls
        self._instance: Any = None
        self.services = services

    async def __call__(self, sample: Any, ctx: Any) -> Any:
        if self._instance is None:
            from importlib import import_module

            self._instance = getattr(import_module(self._module), self._cls)()
        return await self._instance(sample, ctx)


@hookimpl
def miles_register_generators(register: Register) -> None:
    register("multi_turn", _LazyGenerator("miles_tito.generators.multi_turn", "MultiTurnGenerator"))
    register("agentic", _LazyGenerator("miles_tito.generators.agentic", "AgenticGenerator", services=(SESSION,)))


@hookimpl
def miles_register_services(register: Register) -> None:
    from miles_tito.server.launch import SessionServerService

    register("session", SessionServerService())


@hookimpl
def miles_register_tools(register: Register) -> None:
    register("calculator", Calculator())


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_tito.config import TitoSection

    register("tito", TitoSection)


def _command(module: str, help: str, description: str | None = None) -> Command:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _lazy(module, "add_arguments")(parser)

    return Command(help=help, run=_lazy(module, "run"), add_arguments=add_arguments, description=description)


@hookimpl
def miles_register_commands(register: Register) -> None:
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
    ))
    register("bench session", _command(
        "miles_tito.bench.session",
        "latency the session server adds over calling the engine directly, and requests/s",
    ))
    register("bench tito", _command(
        "miles_tito.bench.tito",
        "incremental TITO tokenization vs re-rendering and re-tokenizing the whole history every turn",
    ))
