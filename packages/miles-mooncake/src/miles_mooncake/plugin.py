"""Plugin ``mooncake``: the ``mooncake`` weight transport and its config section. Mooncake itself is
imported when a transport starts, so loading this plugin costs nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_contracts import WeightTransport


def mooncake(config: MilesConfig) -> WeightTransport:
    from miles_mooncake.transport import MooncakeTransport

    return MooncakeTransport.from_config(config)


@hookimpl
def miles_register_weight_transports(register: Register) -> None:
    register("mooncake", mooncake)


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_mooncake.settings import MooncakeSection

    register("mooncake", MooncakeSection)
