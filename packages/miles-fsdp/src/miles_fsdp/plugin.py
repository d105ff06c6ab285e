"""Plugin ``fsdp``: the ``fsdp`` train backend, its ``fsdp`` config section and ``miles bench train``.

Light at import time: torch and transformers load only when a backend is built or the benchmark
runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_contracts import TrainBackend


def create_backend(config: MilesConfig) -> TrainBackend:
    """Factory registered as train backend ``fsdp``."""
    from miles_fsdp.backend import FSDPBackend

    return FSDPBackend(config)


@hookimpl
def miles_register_train_backends(register: Register) -> None:
    register("fsdp", create_backend)


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_fsdp.config import FSDPSection

    register("fsdp", FSDPSection)


@hookimpl
def miles_register_commands(register: Register) -> None:
    from miles_fsdp.bench_cli import BENCH_TRAIN

    register("bench train", BENCH_TRAIN)
