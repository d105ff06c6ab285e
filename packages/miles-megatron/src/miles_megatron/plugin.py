"""Plugin ``megatron``: the ``megatron`` train backend and its ``megatron`` config section.

Light at import time: torch and megatron-core load only when a backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, RunContext, TrainBackendSpec

if TYPE_CHECKING:
    from miles_contracts import TrainBackend


def create_backend(ctx: RunContext) -> TrainBackend:
    """Factory of train backend ``megatron`` (in each trainer rank)."""
    from miles_megatron.backend import MegatronBackend

    return MegatronBackend(ctx)


@hookimpl
def miles_register_train_backends(register: Register[TrainBackendSpec]) -> None:
    # named_weights() gathers every shard to global rank 0 and yields nothing elsewhere, so only
    # rank 0 can push: the kernel refuses layouts that would have another rank feed a colocated engine
    register("megatron", TrainBackendSpec(create_backend, weights_on_rank0=True))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_megatron.config import MegatronSection

    register("megatron", ConfigSectionSpec(MegatronSection))
