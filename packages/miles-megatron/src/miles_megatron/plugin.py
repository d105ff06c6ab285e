"""Plugin ``megatron``: the ``megatron`` train backend and its ``megatron`` config section.

Light at import time: torch and megatron-core load only when a backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_contracts import TrainBackend


def create_backend(config: MilesConfig) -> TrainBackend:
    """Factory registered as train backend ``megatron``."""
    from miles_megatron.backend import MegatronBackend

    return MegatronBackend(config)


# named_weights() gathers every shard to global rank 0 and yields nothing elsewhere, so only rank 0
# can push: the kernel refuses layouts that would have another rank feed a colocated engine.
create_backend.weights_on_rank0 = True  # type: ignore[attr-defined]


@hookimpl
def miles_register_train_backends(register: Register) -> None:
    register("megatron", create_backend)


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_megatron.config import MegatronSection

    register("megatron", MegatronSection)
