"""Plugin ``fsdp``: the ``fsdp`` train backend, its ``fsdp`` config section and ``miles bench train``.

Light at import time: torch and transformers load only when a backend is built or the benchmark
runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import CommandSpec, ConfigSectionSpec, RunContext, TrainBackendSpec

if TYPE_CHECKING:
    from miles_contracts import TrainBackend


def create_backend(ctx: RunContext) -> TrainBackend:
    """Factory of train backend ``fsdp`` (in each trainer rank)."""
    from miles_fsdp.backend import FSDPBackend

    return FSDPBackend(ctx)


@hookimpl
def miles_register_train_backends(register: Register[TrainBackendSpec]) -> None:
    register("fsdp", TrainBackendSpec(create_backend))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_fsdp.config import FSDPSection

    register("fsdp", ConfigSectionSpec(FSDPSection))


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    from miles_fsdp.bench_cli import BENCH_TRAIN

    register("bench train", BENCH_TRAIN)
